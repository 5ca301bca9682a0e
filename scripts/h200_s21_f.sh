#!/usr/bin/env bash
# Session 21, call F (< 9 min): the ping-pong kernels hand the MMA turn to the other warpgroup right after issuing a
# tile's last MMAs (as CUTLASS's ping-pong does), not after they complete (call E: the weight gradient's tensor pipe
# idled 28% of DeepSeek-V3's FC1 launch, whose tiles have 4 reduction steps). (1) The ping-pong GPU tests (now with
# the early turn); (2) early against late, queued, in turns, with torch.
source scripts/device_common.sh "$@"
gpu_test_subset pingpong 240 tests/kernels/test_wgrad_pingpong_gpu.py tests/kernels/test_rowgroup_pingpong_gpu.py \
  tests/kernels/test_moe_fused_gpu.py
timeout -k 10 330 python3 scripts/early_turn_bench.py --shapes dsv3,qwen3 --routing balanced,layer-skewed \
  --rounds 3 > "$out/early.log" 2>&1
echo "rc $?"; filter < "$out/early.log" | tail -36
