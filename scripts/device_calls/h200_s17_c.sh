#!/usr/bin/env bash
# Session 17, call C (< 9.5 min): the row-kernel and fused-path tests on the GPU in full (call B's run hit its time
# limit with 47 passed, none failed), then DeepSeek-V3's layer on both routings with x_perm written token by token
# (without the compiled reference: its ratios are session 16's), then GPT-OSS's.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== row kernels and fused path (plain pytest: not marked gpu)"
timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_rows.py \
  tests/kernels/test_moe_fused.py > "$out/rows_tests.log" 2>&1; grep -E "passed|failed|FAILED|Error" "$out/rows_tests.log" | tail -4
echo "== DeepSeek-V3 layer, balanced and skewed (no compiled reference)"
run_bench deepseek-v3 balanced,skewed 3 1 300 --no-compile
echo "== GPT-OSS layer, balanced"
run_bench gpt-oss-20b balanced 5 2 110
