#!/usr/bin/env bash
# Session 13, call H: FC2's data gradient with SwiGLU's backward, its epilogue rewritten (da converted to 16-byte rows
# per thread, g / u loaded and dh stored from registers, no shared buffers passed between the consumers, 5-6 stages).
# Every ping-pong GPU test, then the fused kernel against the separate pairs in turns.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset pp_tests 120 tests/kernels/test_rowgroup_pingpong_gpu.py || exit 1
echo "== FC2 dgrad + SwiGLU backward: separate vs fused"
timeout -k 5 150 python3 scripts/fc2_dgrad_swiglu_bench.py --shapes qwen3,gptoss,mixtral,dsv3 --rounds 3 \
  --stages 5,6 > "$out/fc2_swiglu.log" 2>&1
filter < "$out/fc2_swiglu.log" | tail -6
