#!/usr/bin/env bash
# The whole GPU session in one call (device time is scarce): the judge figures first (issues 11, 7), then
# the twin checks, then the 8B decode benchmark (issue 3) with whatever time is left under ALL_LIMIT_S.
# Everything is packed into $OUT/gpu-all.tgz at the end (a call brings back at most 8 files).
# Usage on the device:  SPECDEC_COMMIT=<sha> bash bench/gpu_all.sh "$OUT"   (with .whl carried)
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
LIMIT=${ALL_LIMIT_S:-580}
HEALTH_WAIT_S=${HEALTH_WAIT_S:-150} TWIN_JUDGE_S=${TWIN_JUDGE_S:-100} PAIR_JUDGE_S=${PAIR_JUDGE_S:-40} timeout $((LIMIT - 110)) bash bench/gpu_judge.sh "$OUT"
echo "judge stages rc=$? done at ${SECONDS}s"
pkill -f "specdec.cli serve"; sleep 2
left=$((LIMIT - SECONDS))
if [ "$left" -gt 60 ]; then
  PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout "$left" python3 bench/decode.py --out "$OUT/decode-h200.json" --steps 20 \
    > "$OUT/decode.log" 2>&1
  echo "decode rc=$? at ${SECONDS}s"; grep -v "^{" "$OUT/decode.log" | tail -n 12
fi
cd "$OUT" && tar -czf /tmp/gpu-all.tgz . && rm -rf ./* && mv /tmp/gpu-all.tgz . && ls -la
