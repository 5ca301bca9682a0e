#!/usr/bin/env bash
# Session 12, call C: FC2's data gradient with SwiGLU's backward in the ping-pong's epilogue
# (rowgroup_pingpong.grouped_gemm_dgrad_swiglu_pingpong), first GPU run: its tests (float64, the separate kernels),
# then against the separate data gradient + SwiGLU backward kernel at every layer's FC2.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset rg_swiglu_tests 150 tests/kernels/test_rowgroup_pingpong_gpu.py || exit 1
echo "== FC2 dgrad + SwiGLU backward, balanced"
timeout -k 5 240 python3 scripts/fc2_dgrad_swiglu_bench.py --shapes qwen3,gptoss,mixtral,dsv3 --rounds 3 \
  --routing balanced,skewed > "$out/fc2_swiglu.log" 2>&1
filter < "$out/fc2_swiglu.log" | tail -12
