#!/usr/bin/env bash
# GPU calls on why the Qwen3.5-27B twin's team load gains less than its steps promise (issue 22).  Call 1 (the
# default, ~300 s): (1) one team-like prefill, plain (the ragged layout, and the chunked form before it) and with
# MTP k = 2 (its head's observe and first chain), each profiled (bench/prefill.py); (2) batch-16 steps of plain,
# MTP k = 2 and MTP k = 2 over a 32,768-row draft vocabulary, profiled (bench/spec_steps.py).  Call 2
# (JUDGE=1 PREFILL=0 STEPS=0, ~300 s): the judge at k <= MTP_K (2), the candidate over that draft vocabulary; its record
# holds each engine's steps, eager steps and their seconds per load.  Each stage has its own limit.
# From a tree without ref-target, ref-draft and ref-head (the device copy's 64 MiB).
# Usage on the device:  SPECDEC_COMMIT=<sha> [JUDGE=1 PREFILL=0 STEPS=0] bash bench/gpu_team.sh "$OUT"   (.whl carried)
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
LIMIT=${ALL_LIMIT_S:-585}
STAGE_MIN_S=20 STAGE_TAIL=${STAGE_TAIL:-16}
source "$(dirname "$0")/stage.sh"
TWIN=${TWIN:-qwen3.5-27b} TAG=${SPECDEC_COMMIT:-unknown}
PREFILL_CMD="python3 bench/prefill.py --target ref-hybrid --twin $TWIN --max-tokens 2 --top 40"
if [ "${PREFILL:-1}" != 0 ]; then
  stage prefill-plain 110 $PREFILL_CMD --variants eager,eager-chunked --out "$OUT/prefill-twin27b-plain-t2-$TAG.json"
  stage prefill-mtp 70 $PREFILL_CMD --variants eager --speculator mtp --num-draft-tokens 2 \
    --out "$OUT/prefill-twin27b-mtp2-t2-$TAG.json"
fi
[ "${STEPS:-1}" = 1 ] && stage steps ${STEPS_STAGE_S:-200} python3 bench/spec_steps.py --target ref-hybrid \
  --target-twin "$TWIN" --batch 16 --prompts 16 --tokens 48 --configs ${STEPS_CONFIGS:-plain,mtp-k2,mtp-k2-v32k} \
  --profile-steps ${PROFILE_STEPS:-4} --out "$OUT/spec-steps-bs16-twin27b-mtp-$TAG.json"
[ "${JUDGE:-0}" = 1 ] && MTP_K=${MTP_K:-2} STEPS=0 KERNEL=0 CAND_EXTRA="${CAND_EXTRA---draft-vocab-size 32768}" \
  JUDGE_STAGE_S=$((LIMIT - SECONDS - 15)) ALL_LIMIT_S=$((LIMIT - SECONDS)) \
  bash "$(dirname "$0")/gpu_hybrid_judge.sh" "$OUT"
ls -la "$OUT"
