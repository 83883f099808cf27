#!/usr/bin/env bash
# The judge figures on one GPU (issues 7, 11); bench/gpu_all.sh runs it as its first stage.
# Engines run as long-lived servers on one GPU (judged through their URLs, so each starts once);
# each stage has its own time limit so that a slow stage cannot lose the others' results.
# Usage on the device:  SPECDEC_COMMIT=<sha> bash bench/gpu_judge.sh "$OUT"   (with .whl carried)
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import fastapi, uvicorn, pydantic; import specdec.server.app" || { echo "server imports fail: fix the wheel set (scripts/fetch_gpu_wheels.sh)"; exit 1; }
# busy = "KV cache nearly full" (JUDGE.md): every engine gets a KV cache of KV_TOKENS target tokens, small
# enough that the judge's calibration (from the stock engine's /metrics) reaches >= 90 % use below
# --max-num-seqs; a drafter gets a KV cache of the same number of tokens on top (within the memory slack).
SERVE="python3 -m specdec.cli serve --device ${DEVICE:-cuda} --max-num-seqs 64 --kv-cache-tokens ${KV_TOKENS:-6000} --max-model-len 2048 ${SERVE_EXTRA}"  # e.g. SERVE_EXTRA=--fixed-acceptance
# team at JUDGE.md's default of 16 lanes, 16 prompts a pass (the 2026-12-03 records used 8 and 8: their passes
# spread by +-10 %)
JUDGE="python3 -m specdec.cli judge ${JUDGE_SIZES:---num-prompts 16 --max-tokens 64 --concurrency 16 \
  --busy-max-tokens 96 --gate-prompts 8} --passes 3 --request-timeout 120 --startup-timeout 240 --quiet"

start() {  # start NAME PORT ARGS...: a server in the background, its log in $OUT
  local name=$1 port=$2; shift 2
  $SERVE --port "$port" "$@" > "$OUT/serve-$name.log" 2>&1 &
  PIDS="$PIDS $!"
}
wait_healthy() {  # every port healthy, or give up as soon as a server process has died
  for p in "$@"; do
    for _ in $(seq "${HEALTH_WAIT_S:-240}"); do
      curl -sf "localhost:$p/health" >/dev/null && break
      for pid in $PIDS; do kill -0 "$pid" 2>/dev/null || { echo "a server died: see $OUT/serve-*.log"; tail -n 3 "$OUT"/serve-*.log; exit 1; }; done
      sleep 1
    done
  done
}
judge() {  # judge NAME STOCK_PORT CAND_PORT SECONDS TITLE
  timeout "$4" $JUDGE --stock "http://127.0.0.1:$2" --candidate "http://127.0.0.1:$3" --out "$OUT/judge-$1" \
    --title "$5" > "$OUT/judge-$1.log" 2>&1; echo "judge $1 rc=$?"; tail -n 25 "$OUT/judge-$1.log"
  cp "$OUT/judge-$1/record.json" "$OUT/judge-h200-$1.json" 2>/dev/null; rm -f "$OUT/judge-$1"/*.log
}

HEAD_MODEL=${HEAD_MODEL:-ref-head}  # the EAGLE-3 head of the eagle3 / eagletree candidates (a name or a directory)
TWINS=${TWINS-draft ngram}  # which twin candidates to judge (draft, eagle3, eagletree, ngram; "" for none); PAIR=0 skips the small pair
if [ -n "$TWINS" ]; then
# 1. the headline: ref-target as a qwen3-8b twin, drafter ref-draft as a qwen3-0.6b twin, and n-gram
start stock8b 8100 ref-target --twin qwen3-8b
ports=8100
case " $TWINS " in *" draft "*)
  # the drafter's weights (1.2 GB) and KV (114688 B/token) fit the memory gate's 4 GiB slack at 6000 tokens
  start draft8b 8101 ref-target --twin qwen3-8b --speculator draft --draft-model ref-draft --draft-twin qwen3-0.6b \
    --num-draft-tokens 8; ports="$ports 8101" ;; esac
case " $TWINS " in *" eagle3 "*)  # the head twin's cache rides on the target's blocks (one layer)
  start eagle8b 8103 ref-target --twin qwen3-8b --speculator eagle3 --draft-model $HEAD_MODEL --draft-twin qwen3-8b \
    --num-draft-tokens 7; ports="$ports 8103" ;; esac
case " $TWINS " in *" eagletree "*)  # the head drafting trees: 5 deep, 3 candidates a depth (15 nodes)
  start tree8b 8104 ref-target --twin qwen3-8b --speculator eagle3 --draft-model $HEAD_MODEL --draft-twin qwen3-8b \
    --num-draft-tokens 5 --tree-width 3; ports="$ports 8104" ;; esac
case " $TWINS " in *" ngram "*)
  start ngram8b 8102 ref-target --twin qwen3-8b --speculator ngram --num-draft-tokens 8; ports="$ports 8102" ;; esac
wait_healthy $ports; echo "twin servers up at ${SECONDS}s"
[ -n "$WARMUP" ] && python3 bench/warmup.py $ports
case " $TWINS " in *" draft "*)
  judge twin8b-draft 8100 8101 ${TWIN_JUDGE_S:-120} "ref-target as qwen3-8b twin, drafter ref-draft as qwen3-0.6b twin (k=8)" ;; esac
case " $TWINS " in *" eagle3 "*)
  judge twin8b-eagle3 8100 8103 ${TWIN_JUDGE_S:-120} "ref-target as qwen3-8b twin, EAGLE-3 head $HEAD_MODEL as its twin (k=7)" ;; esac
case " $TWINS " in *" eagletree "*)
  judge twin8b-eagle3-tree 8100 8104 ${TWIN_JUDGE_S:-120} "ref-target as qwen3-8b twin, EAGLE-3 head $HEAD_MODEL as its twin drafting trees (k=5, width 3)" ;; esac
case " $TWINS " in *" ngram "*)
  judge twin8b-ngram 8100 8102 ${TWIN_JUDGE_S:-120} "ref-target as qwen3-8b twin, n-gram speculator (k=8)" ;; esac
for p in $ports; do curl -sf "localhost:$p/metrics" > "$OUT/metrics-$p.txt"; done  # what each engine did, in all
kill $PIDS; wait; PIDS=""; echo "twin judges done at ${SECONDS}s"
fi

[ "${PAIR:-1}" = 0 ] && { echo "judges done at ${SECONDS}s"; exit 0; }
# 2. the reference pair itself
start stock 8200 ref-target
start draft 8201 ref-target --speculator draft --draft-model ref-draft --num-draft-tokens 8
start ngram 8202 ref-target --speculator ngram --num-draft-tokens 8
wait_healthy 8200 8201 8202; [ -n "$WARMUP" ] && python3 bench/warmup.py 8200 8201 8202
judge draft 8200 8201 ${PAIR_JUDGE_S:-45} "ref-target, drafter ref-draft (k=8)"
judge ngram 8200 8202 ${PAIR_JUDGE_S:-45} "ref-target, n-gram speculator (k=8)"
kill $PIDS; wait; PIDS=""; echo "pair judges done at ${SECONDS}s"

echo "judges done at ${SECONDS}s"
