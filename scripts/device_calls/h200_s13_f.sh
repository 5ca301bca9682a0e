#!/usr/bin/env bash
# Session 13, call F: the GPU tests of the changed code on the final commit (the ping-pong kernels incl. both fused
# epilogues, the layer's fused path), then Mixtral's layer with every peer (the compiled reference included).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset final_tests 250 tests/kernels/test_rowgroup_pingpong_gpu.py tests/kernels/test_moe_fused_gpu.py \
  -k "not compiled"
echo "== Mixtral layer"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 300 python3 -m moetrain bench moe --backends auto \
  --graphs --host-ahead --shapes mixtral-8x7b --routing balanced --reps 3 --warmup 1 > "$out/mixtral.log" 2>&1
filter < "$out/mixtral.log" | grep -E "^mixtral|moe_fc1" | grep -v "per-expert" | tail -14
