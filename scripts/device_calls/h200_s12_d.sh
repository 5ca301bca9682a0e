#!/usr/bin/env bash
# Session 12, call D: the ping-pong forward / data gradient as autotuner candidates (GPU tests of the dispatch and
# the CUDA-graph replay, then bench gemm's six GEMMs with auto), and the fused FC2 data gradient + SwiGLU backward
# again (one sigmoid per element now) with one launch under Nsight Compute: where its epilogue's ~40 us per tile go.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset pp_tests 200 tests/kernels/test_rowgroup_pingpong_gpu.py tests/kernels/test_grouped_gemm_gpu.py \
  -k "pingpong or trial or graph" || exit 1
echo "== fused FC2 dgrad + SwiGLU backward"
timeout -k 5 60 python3 scripts/fc2_dgrad_swiglu_bench.py --shapes qwen3,mixtral --rounds 3 --stages 4 \
  > "$out/fc2_swiglu.log" 2>&1
filter < "$out/fc2_swiglu.log" | tail -3
ncu_profile fused_swiglu python3 scripts/fc2_dgrad_swiglu_bench.py --shapes qwen3 --stages 4 --profile
echo "== six GEMMs (auto with the ping-pong candidates)"
timeout -k 5 200 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --routing balanced --budget 170 \
  > "$out/gemm.log" 2>&1
filter < "$out/gemm.log" | grep -E "^(dsv3|qwen3)|sum|six|auto" | tail -22
