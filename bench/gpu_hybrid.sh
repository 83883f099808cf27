#!/usr/bin/env bash
# One GPU call for ref-hybrid, the Qwen3.5-shaped (hybrid) reference target (issue 22). NOT YET RUN: written
# and dry-run on CPU only (the pieces: tests/test_train_lm_qwen3_5.py; bench/hybrid_check.py on a tiny
# checkpoint), never on a GPU; first run's timings and figures are unknown.
# Stages, each with its own limit and never past ALL_LIMIT_S: a corpus (the recipe of ref-target's, 320 MB),
# (MTP=1: after the check, `specdec train head --kind mtp` on it for MTP_MIN minutes, brought back as
# ref-hybrid-mtp.tar.partNN, the target with its trained mtp.* weights),
# `specdec train lm --arch qwen3_5` (the default hybrid shape, ~16.4M parameters; ref-target's tokenizer, so
# the two targets score the same tokens) for TRAIN_MIN minutes, then bench/hybrid_check.py: held-out loss
# beside ref-target's, and the engine's greedy output against transformers' generate. Works in /tmp/hy;
# brings back the logs, hybrid-check.json and the checkpoint as ref-hybrid.tar.partNN pieces of 15 MiB
# (unpack: cat ref-hybrid.tar.part* | tar -xf - -C specdec/assets).
# Without flash-linear-attention and causal-conv1d on the device, transformers runs the Gated DeltaNet layers
# through its reference PyTorch code, so the hybrid sees fewer tokens per second than ref-target did.
# Usage on the device:  SPECDEC_COMMIT=<sha> bash bench/gpu_hybrid.sh "$OUT"   (TRAIN_MIN and TRAIN_STAGE_S size
# the training: one call runs at most 600 s; LM_ARGS adds to the training command's arguments)
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LIMIT=${ALL_LIMIT_S:-585}; W=/tmp/hy
nvidia-smi -L
[ -n "$SPECDEC_COMMIT" ] || echo "warning: SPECDEC_COMMIT is unset: the records cannot name their commit (the device copy has no git history)"
python3 -c "import transformers; transformers.Qwen3_5ForCausalLM" || { echo "this transformers has no Qwen3.5"; exit 1; }
STAGE_MIN_S=20 STAGE_TAIL=12
source "$(dirname "$0")/stage.sh"
stage corpus 60 python3 -m specdec.data.corpus --out $W/corpus --max-bytes ${CORPUS_BYTES:-320000000} \
  --heldout-fraction 0.03 --seed 0
stage pretrain ${TRAIN_STAGE_S:-430} python3 -m specdec.cli train lm --arch qwen3_5 --corpus $W/corpus \
  --tokenizer specdec/assets/ref-target --out $W/ref-hybrid --max-minutes ${TRAIN_MIN:-6} \
  --seq-len 512 --batch-size 128 --eval-windows 64 --max-shard-size 16MB $LM_ARGS
[ -f $W/ref-hybrid/config.json ] && {
  stage check 70 python3 bench/hybrid_check.py --model $W/ref-hybrid --compare ref-target --n-prompts 16 \
    --new-tokens 64 --out "$OUT/hybrid-check.json"
  tar -cf - -C $W ref-hybrid | split -b 15m -d - "$OUT/ref-hybrid.tar.part"  # a file back is at most 16 MiB
  [ "${MTP:-0}" = 1 ] && {
    stage train_mtp ${MTP_STAGE_S:-150} python3 -m specdec.cli train head --kind mtp --target $W/ref-hybrid \
      --prompts $W/corpus --out $W/mtp --n-prompts ${MTP_PROMPTS:-2000} --max-minutes ${MTP_MIN:-1.5} \
      --ttt-steps 3 --max-steps 100000 --checkpoint-every 500 --drop-overlap --no-progress
    [ -f $W/mtp/export/bf16/config.json ] && (cd $W/mtp && tar -cf - DATA_MANIFEST.md result.json run.json \
      train_log.jsonl export/bf16 | split -b 15m -d - "$OUT/ref-hybrid-mtp.tar.part")
  }
}
ls -la "$OUT"
