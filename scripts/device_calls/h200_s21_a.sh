#!/usr/bin/env bash
# Session 21, call A (< 9 min): what bounds DeepSeek-V3's FC1 forward (never profiled; only the weight gradient was,
# in session 9). Nsight Compute, one launch each of ours and torch._grouped_mm: the Triton 128x256 config on balanced
# and skewed routing, the ping-pong s5 on balanced. Then every forward / data-gradient config at DeepSeek-V3 on both
# routings (bench gemm), for auto's choice between routings (FC2's forward and data gradient at 0.99x torch).
source scripts/device_common.sh "$@"
ncu_gemm fwd_bal_t256 dsv3 fc1 fwd balanced 128x256x64/s3/w8/tma
ncu_gemm fwd_skew_t256 dsv3 fc1 fwd skewed 128x256x64/s3/w8/tma
ncu_gemm fwd_bal_pp5 dsv3 fc1 fwd balanced pingpong/128x128x64/s5/g8
echo "== bench gemm, DeepSeek-V3, forward and data gradient, both routings"
timeout -k 10 300 python3 -m moetrain bench gemm --shapes dsv3 --ops fwd,dgrad --routing balanced,skewed --budget 200 \
  > "$out/gemm_dsv3.log" 2>&1
echo "rc $?"; filter < "$out/gemm_dsv3.log" | grep -E "^dsv3|auto picked|^    [0-9p]" | tail -24
