#!/usr/bin/env bash
# Next session, call A (< 9 min): FC1 with SwiGLU in its epilogue, now with the paired (one-accumulator) variant
# as default: its GPU tests, both variants alone against plain forward + SwiGLU kernel per config (Mixtral, gathered
# rows as in the layer; Qwen3), then the layers with and without it, eager and graphed.
source scripts/device_common.sh "$@"
timeout -k 5 150 python3 -m pytest -q tests/kernels/test_fc1_swiglu.py tests/kernels/test_moe_fused_gpu.py \
  -k "fc1_swiglu or True" -p no:cacheprovider -rf 2>&1 | tail -4
for shape in mixtral-8x7b qwen3-30b-a3b; do
  timeout -k 5 90 python3 scripts/fc1_swiglu_alone.py --shape $shape --gather --rounds 3 2>&1 | filter | head -16
done
timeout -k 5 200 python3 -m moetrain bench moe --shapes mixtral-8x7b,qwen3-30b-a3b --routing balanced --reps 3 \
  --warmup 1 --backends triton --fc1-swiglu --no-compile --graphs 2>&1 | filter | grep -E "^mixtral|^qwen3|Error" | tail -16
