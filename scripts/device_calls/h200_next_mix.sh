#!/usr/bin/env bash
# Next session, first call (~4 min; written in session 11, whose device time ran out first): the "mix" schedule
# (kernels/schedule.py: groups heaviest first; on skewed routing half the programs walk backwards) in the ping-pong
# weight gradient and the forward / data gradient kernel. GPU tests (bitwise equal to the plain schedule, float64;
# every trial config on skewed routing), then DeepSeek-V3's weight gradients on balanced, bench moe's skewed and
# Dirichlet-skewed routing, and its forward / data gradients in bench gemm's sweep (the mix config is on trial there).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset mix_tests 120 tests/kernels/test_wgrad_pingpong_gpu.py tests/kernels/test_grouped_gemm_gpu.py \
  -k "mix or cohorts or trial" || exit 1
echo "== weight gradient"
timeout -k 5 90 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3 --rounds 3 \
  --routing balanced,layer-skewed,skewed --variants 128x128/s4/g8,128x128/s4/g8/c2,128x128/s4/g8/mix \
  > "$out/mix_bench.log" 2>&1
filter < "$out/mix_bench.log" | tail -8
echo "== forward / data gradient"
timeout -k 5 150 python3 -m moetrain bench gemm --shapes dsv3 --ops fwd,dgrad --routing balanced,skewed \
  --budget 110 > "$out/mix_gemm.log" 2>&1
filter < "$out/mix_gemm.log" | grep -E "split/mix|split [0-9]|^dsv3|ours" | tail -16
