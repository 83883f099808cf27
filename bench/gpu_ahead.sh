#!/usr/bin/env bash
# One GPU call for what runs ahead of the host on a speculative step (issue 21): bench/spec_steps.py at batch 1
# with a head's observe and the next chain behind it launched before the acceptance read, the observe alone
# (--no-chain-ahead) and neither (--no-early-observe), every engine with fixed
# acceptance; then a table of mean and median step times per config.  Default: the Qwen3.5-27B twin with its
# MTP head (a tree without ref-target, ref-draft and ref-head fits the device copy); the 8B twin with its
# EAGLE-3 head: TARGET=ref-target TWIN=qwen3-8b PLAIN_CONFIGS=plain,eagle3-k5 CONFIGS=eagle3-k5 (a tree
# without ref-hybrid).
# Usage on the device:  SPECDEC_COMMIT=<sha> bash bench/gpu_ahead.sh "$OUT"   (.whl carried)
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
TARGET=${TARGET:-ref-hybrid} TWIN=${TWIN:-qwen3.5-27b}
CONFIGS=${CONFIGS:-mtp-k1,mtp-k2}
steps() {  # steps NAME SPEC_STEPS_ARGS...: one spec_steps run, its JSON rows left out of the log
  local name=$1; shift
  timeout "${RUN_LIMIT_S:-130}" python3 bench/spec_steps.py --target "$TARGET" --target-twin "$TWIN" \
    --prompts "${PROMPTS:-3}" --tokens "${TOKENS:-48}" --fixed-acceptance "$@" \
    --out "$OUT/spec-steps-ahead-$name.json" 2>&1 | grep -v '^{' | tail -12
}
steps ahead --configs "${PLAIN_CONFIGS:-plain,$CONFIGS}"  # the observe and the next chain ahead of the read
steps nochain --configs "$CONFIGS" --no-chain-ahead  # the observe alone ahead
steps late --configs "$CONFIGS" --no-early-observe  # neither (a chain runs ahead only behind an early observe)
python3 - "$OUT" <<'PY'
import glob, json, sys
print(f"{'run':<8} {'config':<14} {'k':>2} {'mean ms':>8} {'median':>8} {'tokens/step':>11} {'tok/s':>7}")
for path in sorted(glob.glob(f"{sys.argv[1]}/spec-steps-ahead-*.json")):
    run = path.rsplit("-", 1)[-1][:-5]
    for row in json.load(open(path))["rows"]:
        for k, v in row["by_k"].items():
            print(f"{run:<8} {row['config']:<14} {k:>2} {v['step_ms']:8.2f} {v.get('median_ms', 0):8.2f} "
                  f"{v['tokens_per_step']:11.2f} {row['tok_s']:7.1f}")
PY
