#!/usr/bin/env bash
# Session 26, call A (< 9 min): the row kernels with their new program knobs (RowTile, the route's and the sort's)
# on the GPU: their tests in bf16, then scripts/row_kernel_sweep.py: every candidate program against the rule in use,
# the PyTorch op doing the same job and a copy of the same bytes, in turns, at the benchmark shapes (the routing
# kernels at the two many-expert shapes only: their compiles are per expert count).
source scripts/device_common.sh "$@"
gpu_test_subset rows 150 tests/kernels/test_moe_rows.py tests/kernels/test_route.py tests/kernels/test_sort_rows.py
echo "== row passes, 4 shapes"
timeout -k 10 260 python3 scripts/row_kernel_sweep.py --kernels token_rows,combine,swiglu_bwd,swiglu_fwd --rounds 5 \
  --json "$out/sweep_rows.json" 2>&1 | filter
echo "== routing kernels, qwen3 and deepseek-v3"
timeout -k 10 150 python3 scripts/row_kernel_sweep.py --shapes qwen3-30b-a3b,deepseek-v3 --kernels route,route_bwd,sort \
  --rounds 5 --json "$out/sweep_routing.json" 2>&1 | filter
