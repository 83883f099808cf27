#!/usr/bin/env bash
# One GPU call for the drafter-training figures (issue 9) and a stronger ref-draft candidate (issue 6).
# Works in /tmp/td (corpus, base, run); brings back the record, the log and two tarballs (<= 16 MiB each).
# Usage on the device:  bash bench/gpu_drafter.sh "$OUT"   (TD_ARGS overrides the sizes)
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L
timeout "${TD_LIMIT:-545}" python3 bench/train_drafter.py --out /tmp/td --results "$OUT/drafter-training.json" \
  ${TD_ARGS:---base-minutes 3 --n-prompts 16000 --max-steps 2400 --qat-steps 400 --kl-weight 1.0 --eval-every 300} \
  > "$OUT/train_drafter.log" 2>&1
echo "train_drafter rc=$?"; grep -v "it/s\]" "$OUT/train_drafter.log" | tail -n 30
cd /tmp/td/run 2>/dev/null && {
  tar -cf "$OUT/drafter-bf16.tar" DATA_MANIFEST.md result.json run.json train_log.jsonl export/bf16 ../base/pretrain.json
  tar -cf "$OUT/drafter-compact.tar" export/int4 export/fp8
}
ls -la "$OUT"
