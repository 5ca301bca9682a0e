#!/usr/bin/env bash
# Session 18, call A (< 8 min): (1) test_moe_fused.py on a GPU with its grouped GEMMs pinned to their first config
# (session 17 left it unrun there); (2) the weight gradient's anatomy at DeepSeek-V3: every group 16 rows (each tile
# one step, bound by its dw store: how close to the store floor dw.zero_() does it get?), 64 rows, balanced and the
# layer's skewed routing, plain / mix / 2-cohort schedules against torch; (3) GPT-OSS's layer with 9 repetitions and
# the new paired ratio to the floor (the eager 3% criterion sits inside the machine's spread).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== test_moe_fused.py"
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_fused.py > "$out/moe_fused.log" 2>&1
echo "rc $?"; grep -E "passed|failed|FAILED|Error" "$out/moe_fused.log" | tail -5
echo "== weight gradient anatomy, DeepSeek-V3"
timeout -k 10 200 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3 --fill --rounds 3 \
  --routing balanced,uniform:16,uniform:64,layer-skewed \
  --variants 128x128/s4/g8,128x128/s4/g8/mix,128x128/s4/g8/c2 2>&1 | filter | tail -12
echo "== GPT-OSS layer"
run_bench gpt-oss-20b balanced 9 2 220 --no-compile
