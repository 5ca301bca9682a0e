#!/usr/bin/env bash
# Session 18, call F (< 7 min): main as it stands (timing.in_turns now starts each round at another candidate; the
# layer's kernels unchanged). (1) DeepSeek-V3's six GEMMs, auto per op against torch (session 16: 0.98-0.99 at three
# ops, within the tuner's own place-in-round bias); (2) Qwen3's layer on both routings with every peer and the paired
# ratio to the floor.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== bench gemm, DeepSeek-V3, balanced"
timeout -k 10 260 python3 -m moetrain bench gemm --shapes dsv3 --routing balanced --budget 120 \
  > "$out/gemm_dsv3.log" 2>&1
echo "rc $?"; filter < "$out/gemm_dsv3.log" | grep -E "^dsv3|^layer|^deepseek|auto picked|ratio" | tail -16
echo "== Qwen3 layer, balanced and skewed"
run_bench qwen3-30b-a3b balanced,skewed 5 2 230
