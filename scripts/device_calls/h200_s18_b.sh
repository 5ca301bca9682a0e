#!/usr/bin/env bash
# Session 18, call B (< 8 min): (1) test_moe_fused.py on a GPU, stopping at the first failure (call A: 8 failures,
# then its time limit; the pinned first config was bf16's biggest tile, now the first config that runs);
# (2) the ping-pong weight gradient's GPU tests with the new "interleave" schedule; (3) interleave against the plain,
# 2-cohort schedules and torch at DeepSeek-V3 and Qwen3 (call A: DeepSeek-V3's FC1 weight gradient 7.49 ms balanced,
# 10.33 on the layer's skewed routing; every tile one step: 5.16 ms, the dw store floor 4.46).
source scripts/device_common.sh "$@"
echo "== test_moe_fused.py"
timeout -k 10 150 python3 -m pytest -x -q --tb=short -p no:cacheprovider tests/kernels/test_moe_fused.py \
  > "$out/moe_fused.log" 2>&1
echo "rc $?"; grep -vE "^\s*$" "$out/moe_fused.log" | tail -25
echo "== wgrad ping-pong GPU tests"
gpu_test_subset wgrad_pp 150 tests/kernels/test_wgrad_pingpong_gpu.py
echo "== weight gradient schedules"
timeout -k 10 240 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --rounds 3 \
  --routing balanced,layer-skewed,skewed \
  --variants 128x128/s4/g8,128x128/s4/g8/il64,128x128/s4/g8/il128,128x128/s4/g8/il192,128x128/s4/g8/c2 2>&1 \
  | filter | tail -14
