#!/usr/bin/env bash
# One GPU call for the Qwen3.5-27B twin with its MTP head (issue 22): ref-hybrid as the qwen3.5-27b twin
# (decode and verify steps replay CUDA graphs), (1) bench/spec_steps.py at batch 1: plain and MTP step times,
# tokens per step, engine memory and a profile of 8 steps; (2) the judge, stock against MTP k = 1, in the
# judge's alternate layout (one ~55 GB engine up at a time: two do not fit one 80 GB card); (3) the Triton
# delta-rule kernel against the PyTorch recurrent form at the 27B layer's shape (bench/delta_rule_kernel.py).
# Each stage has its own limit.
# Usage on the device:  SPECDEC_COMMIT=<sha> bash bench/gpu_hybrid_judge.sh "$OUT"   (.whl carried)
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
LIMIT=${ALL_LIMIT_S:-585}
STAGE_MIN_S=20 STAGE_TAIL=${STAGE_TAIL:-25}
source "$(dirname "$0")/stage.sh"
TWIN=${TWIN:-qwen3.5-27b}
SERVE="python3 -m specdec.cli serve ref-hybrid --twin $TWIN --device cuda --max-num-seqs ${MAX_SEQS:-24} \
  --kv-cache-tokens ${KV_TOKENS:-4096} --max-model-len 2048 ${SERVE_EXTRA}"  # both; CAND_EXTRA: the candidate's only
# (e.g. CAND_EXTRA="--draft-vocab-size 32768": the MTP head's LM head over 32,768 rows, not 248,320)
[ "${STEPS:-1}" = 1 ] && stage specsteps ${STEPS_STAGE_S:-170} python3 bench/spec_steps.py --target ref-hybrid \
  --target-twin "$TWIN" --configs ${STEPS_CONFIGS:-plain,mtp-k1,mtp-k2} --prompts ${STEPS_PROMPTS:-3} --tokens 48 \
  --profile-steps ${PROFILE_STEPS:-8} --out "$OUT/spec-steps-twin27b-mtp.json"
stage judge ${JUDGE_STAGE_S:-450} python3 -m specdec.cli judge --stock "$SERVE" \
  --candidate "$SERVE --speculator mtp --num-draft-tokens ${MTP_K:-1} ${CAND_EXTRA}" --layout alternate \
  ${JUDGE_SIZES:---num-prompts 8 --max-tokens 48 --concurrency 16 --busy-max-tokens 64 --gate-prompts 8} --passes 3 \
  --request-timeout 120 --startup-timeout 240 --quiet --out "$OUT/judge-twin27b-mtp" \
  --title "ref-hybrid as qwen3.5-27b twin, its MTP head (k=${MTP_K:-1})"
cp "$OUT/judge-twin27b-mtp/record.json" "$OUT/judge-h200-twin27b-mtp.json" 2>/dev/null
for f in "$OUT/judge-twin27b-mtp"/*.log; do tail -c 300000 "$f" > "$f.tail"; rm -f "$f"; done  # their ends, if it failed
[ "${KERNEL:-1}" = 1 ] && stage kernel ${KERNEL_STAGE_S:-60} python3 bench/delta_rule_kernel.py \
  --out "$OUT/delta-rule-kernel.json"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv
ls -la "$OUT"
