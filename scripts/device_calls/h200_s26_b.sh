#!/usr/bin/env bash
# Session 26, call B (< 5 min): the row kernels' program knobs in bf16 on the GPU (their tests, not GPU-marked: run
# by file), then the rest of call A's sweep (scripts/row_kernel_sweep.py, fewer candidates around A's winners):
# the row passes at Mixtral and DeepSeek-V3, the routing kernels at Qwen3 and DeepSeek-V3.
source scripts/device_common.sh "$@"
timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_rows.py \
  tests/kernels/test_route.py tests/kernels/test_sort_rows.py -k "program_shape or swiglu or combine or token_rows" \
  > "$out/rows.log" 2>&1; echo "rows tests rc $?"; grep -E "passed|failed|FAILED" "$out/rows.log" | tail -5
echo "== row passes, mixtral and deepseek-v3"
timeout -k 10 130 python3 scripts/row_kernel_sweep.py --shapes mixtral-8x7b,deepseek-v3 \
  --kernels token_rows,combine,swiglu_bwd,swiglu_fwd --rounds 5 --json "$out/sweep_rows.json" 2>&1 | filter
echo "== routing kernels, qwen3 and deepseek-v3"
timeout -k 10 100 python3 scripts/row_kernel_sweep.py --shapes qwen3-30b-a3b,deepseek-v3 --kernels route,route_bwd,sort \
  --rounds 5 --json "$out/sweep_routing.json" 2>&1 | filter
