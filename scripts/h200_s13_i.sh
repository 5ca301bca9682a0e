#!/usr/bin/env bash
# Session 13, call I: the SwiGLU backward epilogue with g and u of four passes loaded at once (one memory round trip
# per half tile instead of one per pass): its GPU tests, then against the separate pairs at Qwen3 and GPT-OSS.
source scripts/device_common.sh "$@"
gpu_test_subset swiglu_tests 60 tests/kernels/test_rowgroup_pingpong_gpu.py -k "swiglu_backward" || exit 1
timeout -k 5 80 python3 scripts/fc2_dgrad_swiglu_bench.py --shapes qwen3,gptoss --rounds 3 --stages 5 \
  > "$out/fc2_swiglu.log" 2>&1
filter < "$out/fc2_swiglu.log" | tail -3
