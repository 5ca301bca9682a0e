#!/usr/bin/env bash
# Session 7, call H (< 4 min, the session's last device seconds): FC1 with SwiGLU in its epilogue on the GPU:
# its bf16 tests (kernel, layer, CUDA-graph replay), then Mixtral's layer with and without it (one process).
# (As run in session 7; the flag is `--swiglu-fusion fc1` since.)
source scripts/device_common.sh "$@"
timeout -k 5 95 python3 -m pytest -q tests/kernels/test_fc1_swiglu.py tests/kernels/test_moe_fused_gpu.py -k "fc1_swiglu" \
  -p no:cacheprovider -rf 2>&1 | tail -4
timeout -k 5 110 python3 -m moetrain bench moe --shapes mixtral-8x7b --routing balanced --reps 3 --warmup 1 \
  --backends triton --fc1-swiglu --no-compile --graphs 2>&1 | filter | grep -E "^mixtral|Error" | tail -10
