#!/usr/bin/env bash
# Session 21, call B (< 9 min): half tails in the Triton forward / data gradient (HALF: a group's last tile with at
# most half its rows runs half-height MMAs, in the same launch). Call A's profile: on skewed routing the 128x256
# config runs at the padded-MMA bound (6.70 ms under ncu against 5.37 balanced: +25%, the 128-row tiles' padding +28%),
# with DRAM at 52%. (1) the trial configs' GPU tests (bf16, skewed routing, empty groups, trailing rows); (2) queued,
# in turns, with torch and the autotuner's pick: DeepSeek-V3 and Qwen3 forward and data gradient, half tails or not.
source scripts/device_common.sh "$@"
gpu_test_subset trial 200 tests/kernels/test_grouped_gemm_gpu.py -k "trial_configs and (fwd or dgrad)"
v=128x256x64/s3/w8/tma,128x256x64/s3/w8/tma/half,128x128x64/s4/w4/tma,128x128x64/s4/w4/tma/half,pingpong/128x128x64/s5/g8
echo "== DeepSeek-V3"
timeout -k 10 240 python3 scripts/rowgroup_pingpong_bench.py --shapes dsv3 --rounds 3 --queued \
  --routing balanced,skewed,layer-skewed --variants "$v" > "$out/dsv3.log" 2>&1
echo "rc $?"; filter < "$out/dsv3.log" | tail -30
echo "== Qwen3"
timeout -k 10 150 python3 scripts/rowgroup_pingpong_bench.py --shapes qwen3 --rounds 3 --queued \
  --routing balanced,layer-skewed --variants "$v" > "$out/qwen3.log" 2>&1
echo "rc $?"; filter < "$out/qwen3.log" | tail -20
