#!/usr/bin/env bash
# Session 17, call B (< 9.5 min): x_perm written token by token (moe_rows.token_rows: combine's backward without
# weights) instead of x.index_select(0, token_of_row), whose reads of x came from HBM K times on skewed routing
# (call A: 0.27 against 0.18 ms per gather at Qwen3). Row-kernel and fused-path tests on the GPU (bf16), then
# Qwen3's layer on both routings with every peer.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== row kernels and fused path (plain pytest: not marked gpu), fused GPU tests"
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_rows.py \
  tests/kernels/test_moe_fused.py tests/kernels/test_host_ops.py > "$out/rows_tests.log" 2>&1; tail -3 "$out/rows_tests.log"
gpu_test_subset fused 150 tests/kernels/test_moe_fused_gpu.py tests/unit/test_gpu.py -k "moe or sync or graph"
echo "== Qwen3 layer, balanced and skewed"
run_bench qwen3-30b-a3b balanced,skewed 5 2 240
echo "== Qwen3 kernel table, skewed (eager, auto)"
timeout -k 10 100 python3 -m moetrain bench moe --backends auto --no-compile --profile --shapes qwen3-30b-a3b \
  --routing skewed --reps 3 --warmup 2 > "$out/qwen3_profile.log" 2>&1
filter < "$out/qwen3_profile.log" | grep -A16 "ours (auto):" | head -18
