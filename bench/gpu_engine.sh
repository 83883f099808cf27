#!/usr/bin/env bash
# One GPU call for the engine benchmarks (issues 3 and 4): bench/decode.py then bench/speculative.py.
# Usage on the device:  SPECDEC_COMMIT=<sha> bash bench/gpu_engine.sh "$OUT"
OUT=${1:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 330 python3 bench/decode.py --out "$OUT/decode-h200.json" 2>&1 | tee "$OUT/decode.log"
timeout 200 python3 bench/speculative.py --out "$OUT/speculative-h200.json" 2>&1 | tee "$OUT/speculative.log"
