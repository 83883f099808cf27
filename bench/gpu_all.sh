#!/usr/bin/env bash
# A whole GPU session in one call (device time is scarce): the stages named in STAGES, in order, each with
# its own time limit and never past ALL_LIMIT_S, then everything packed into $OUT/gpu-all.tgz (a call
# brings back at most 8 files).
#   judge        bench/gpu_judge.sh: twins (qwen3-8b target, 0.6b drafter; n-gram) and the reference pair (issues 11, 7)
#   twin         bench/twin.py: twin vs small model greedy agreement, twin vs random-weight step time (issue 11)
#   decode       bench/decode.py: the 8B decode tables, verify cost, kernel profiles (issues 3, 21)
#   decodetriton the same with the Triton paged-attention backend, no transformers peer (issue 21)
#   speculative  bench/speculative.py: the pair, draft and n-gram, concurrency 1/16/64 (issue 4)
#   specpiece    the same with piecewise graphs for eager steps and no transformers peer
#   specsteps    bench/spec_steps.py: batch-1 step times by k and engine memory, twin target and drafter (issues 4, 11)
#   attnshapes   bench/attention_shapes.py: first and steady cost of attention at new shapes, cuDNN vs any-shape
#   attnkernel   bench/attention_kernel.py: the Triton paged-attention kernel vs gather + SDPA, 8B heads, decode/verify
#   eager        bench/eager_steps.py: eager step cost, compiled vs plain pieces vs piecewise graphs (issue 4)
#   draftverify  bench/draft_verify.py: ref-draft over /draft, tau and serving time at concurrency 32 (issue 8)
# Usage on the device:  STAGES="judge twin" SPECDEC_COMMIT=<sha> bash bench/gpu_all.sh "$OUT"   (.whl carried)
# Stage limits: JUDGE_STAGE_S, SPEC_STAGE_S, DV_STAGE_S, EAGER_STAGE_S; extra arguments: SPEC_ARGS, DV_ARGS, DECODE_ARGS (DECODE_STAGE_S); gpu_judge.sh
# reads TWINS ("draft ngram") and PAIR (1).
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
LIMIT=${ALL_LIMIT_S:-580}
STAGES=${STAGES:-judge twin decode}
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

source "$(dirname "$0")/stage.sh"
for s in $STAGES; do
  case $s in
    judge) HEALTH_WAIT_S=${HEALTH_WAIT_S:-150} TWIN_JUDGE_S=${TWIN_JUDGE_S:-170} PAIR_JUDGE_S=${PAIR_JUDGE_S:-40} \
             stage judge ${JUDGE_STAGE_S:-470} bash bench/gpu_judge.sh "$OUT"; pkill -f "specdec.cli serve"; sleep 2 ;;
    twin) stage twin 90 python3 bench/twin.py --out "$OUT/twin-h200.json" --pairs ref-target:qwen3-8b --prompts 8 --steps 10 ;;
    decode) stage decode ${DECODE_STAGE_S:-240} python3 bench/decode.py --out "$OUT/decode-h200.json" --steps 20 $DECODE_ARGS ;;
    decodetriton) stage decodetriton ${DECODE_STAGE_S:-240} python3 bench/decode.py --out "$OUT/decode-triton-h200.json" \
             --steps 20 --skip-hf --attention-backend triton $DECODE_ARGS ;;
    speculative) stage speculative ${SPEC_STAGE_S:-200} python3 bench/speculative.py --out "$OUT/speculative-h200.json" $SPEC_ARGS ;;
    specpiece) stage specpiece ${SPEC_STAGE_S:-200} python3 bench/speculative.py --out "$OUT/speculative-piecewise-h200.json" --piecewise --no-peer $SPEC_ARGS ;;
    specsteps) stage specsteps ${STEPS_STAGE_S:-150} python3 bench/spec_steps.py --out "$OUT/spec-steps-h200.json" $STEPS_ARGS ;;
    accept) stage accept ${ACCEPT_STAGE_S:-90} python3 bench/accept_ragged.py --out "$OUT/accept-ragged-h200.json" --k 3 $ACCEPT_ARGS ;;
    attnshapes) stage attnshapes 60 python3 bench/attention_shapes.py --out "$OUT/attention-shapes-h200.json" ;;
    attnkernel) stage attnkernel 90 python3 bench/attention_kernel.py --out "$OUT/attention-kernel-h200.json" ;;
    eager) stage eager ${EAGER_STAGE_S:-150} python3 bench/eager_steps.py --out "$OUT/eager-steps-h200.json" ;;
    draftverify) stage draftverify ${DV_STAGE_S:-150} python3 bench/draft_verify.py --device cuda --out "$OUT/draft-verify-h200.json" $DV_ARGS ;;
    *) echo "unknown stage $s" ;;
  esac
done
cd "$OUT" && rm -rf ./judge-*/*.log && tar -czf /tmp/gpu-all.tgz . && rm -rf ./* && mv /tmp/gpu-all.tgz . && ls -la
