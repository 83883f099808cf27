#!/usr/bin/env bash
# One GPU call for ref-head, the EAGLE-3 head of ref-target (issue 20): a corpus, `specdec train head`, then
# acceptance per draft position against ref-draft and n-gram (bench/head_acceptance.py) and batch-1 speed
# (bench/speculative.py), each stage with its own limit and never past ALL_LIMIT_S.  Works in /tmp/hd; brings
# back the records, the logs, head-bf16.tar (the bf16 export, manifest, result and training log) and
# head-fp8.tar.
# Usage on the device:  SPECDEC_COMMIT=<sha> bash bench/gpu_head.sh "$OUT"   (HEAD_ARGS adds to the training
# command's arguments; TRAIN_MIN, N_PROMPTS and TRAIN_STAGE_S size the training: one call runs at most 600 s;
# SPEED=0 skips the speed stage, ACC=0 the acceptance stage; ACC_ARGS adds to the acceptance stage's arguments)
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LIMIT=${ALL_LIMIT_S:-585}; W=/tmp/hd
nvidia-smi -L
[ -n "$SPECDEC_COMMIT" ] || echo "warning: SPECDEC_COMMIT is unset: the records cannot name their commit (the device copy has no git history)"
STAGE_MIN_S=20 STAGE_TAIL=12
source "$(dirname "$0")/stage.sh"
# a second call on the warm machine (a larger TRAIN_MIN) resumes the run in $W/run: the corpus and the
# continuations are there already, and --max-minutes counts the minutes trained before
[ -f $W/corpus/manifest.json ] || stage corpus 150 python3 -m specdec.data.corpus --out $W/corpus \
  --max-bytes ${CORPUS_BYTES:-120000000} --heldout-fraction 0.03 --seed 0
stage train_head ${TRAIN_STAGE_S:-430} python3 -m specdec.cli train head --target ref-target --prompts $W/corpus --out $W/run \
  --heldout bench/results/ref-target-heldout.jsonl --n-prompts ${N_PROMPTS:-5000} --max-minutes ${TRAIN_MIN:-4} \
  --max-steps 100000 --checkpoint-every 500 --drop-overlap --no-progress $HEAD_ARGS
HEAD=$W/run/export/bf16
[ -f $HEAD/config.json ] && {
  [ "${ACC:-1}" = 1 ] && stage acceptance 100 python3 bench/head_acceptance.py --head $HEAD --out "$OUT/head-acceptance-h200.json" $ACC_ARGS
  [ "${SPEED:-1}" = 1 ] && stage speed 170 python3 bench/speculative.py --head $HEAD --concurrency 1 --rounds 2 --no-peer \
    --configs plain,draft-adaptive-k8,eagle3-k3,eagle3-k5,eagle3-adaptive-k7 \
    --out "$OUT/speculative-eagle3-h200.json"
}
cd $W/run 2>/dev/null && tar -cf "$OUT/head-bf16.tar" DATA_MANIFEST.md result.json run.json train_log.jsonl export/bf16 \
  && tar -cf "$OUT/head-fp8.tar" export/fp8  # a file back is at most 16 MiB
ls -la "$OUT"
