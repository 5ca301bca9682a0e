#!/usr/bin/env bash
# Session 27, call A (< 9.5 min): the routing kernel on one two-dimensional tile (the group scores a reshaped view,
# the kept groups a compare per slot): its GPU tests, including the 2-token programs with expert groups that picked
# experts past E on session 26's tile; DeepSeek-V3's own grouped routing swept against torch; then the EP8 rank
# view's layer on both routings (not re-run since session 24; the row kernels changed in session 26).
source scripts/device_common.sh "$@"
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_route.py > "$out/tests_route.log" 2>&1
echo "route tests rc $?"; grep -E "passed|failed|FAILED|Error" "$out/tests_route.log" | tail -12
echo "== grouped and plain routing, deepseek-v3 and qwen3"
timeout -k 10 150 python3 scripts/row_kernel_sweep.py --shapes deepseek-v3,qwen3-30b-a3b --kernels route_grouped,route \
  --rounds 5 --json "$out/sweep_route.json" 2>&1 | filter
echo "sweep rc $?"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3-ep8 balanced,skewed 3 1 270 --no-compile
