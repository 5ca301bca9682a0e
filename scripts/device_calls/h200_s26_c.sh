#!/usr/bin/env bash
# Session 26, call C (< 9.5 min): the row kernels' new rules (swiglu_tile, combine_tile, the route's and the sort's
# measured programs): the row, route, sort and fused-layer tests on the GPU (bf16 where they test it); call A's sweep
# of the row passes at Mixtral and DeepSeek-V3 (B's stopped at a tolerance bug of the script); then the Qwen3 layer
# with every peer, balanced routing (the rules' target: within 10% of the six GEMMs).
source scripts/device_common.sh "$@"
timeout -k 10 230 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_rows.py \
  tests/kernels/test_route.py tests/kernels/test_sort_rows.py tests/kernels/test_moe_fused_gpu.py \
  tests/kernels/test_moe_layer_triton.py > "$out/tests.log" 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED" "$out/tests.log" | tail -8
echo "== row passes, mixtral and deepseek-v3"
timeout -k 10 120 python3 scripts/row_kernel_sweep.py --shapes mixtral-8x7b,deepseek-v3 \
  --kernels swiglu_bwd,swiglu_fwd,token_rows,combine --rounds 5 --json "$out/sweep_rows.json" 2>&1 | filter
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench qwen3-30b-a3b balanced 5 2 200 --no-compile
