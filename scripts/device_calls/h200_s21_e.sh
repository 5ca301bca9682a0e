#!/usr/bin/env bash
# Session 21, call E (< 6 min): the ping-pong weight gradient at DeepSeek-V3's FC1 under Nsight Compute (session 9
# profiled the older Triton one: tensor pipe 52%, DRAM 46%). One launch each of ours and torch._grouped_mm, all 256
# experts: the autotuner's usual picks, balanced and skewed routing (sorted there).
source scripts/device_common.sh "$@"
for spec in "wg_bal balanced pingpong/128x128x64/s4/g8" "wg_skew skewed pingpong/128x128x64/s4/g8/sorted" \
            "wg_skew_plain skewed pingpong/128x128x64/s4/g8"; do
  set -- $spec
  ncu_gemm "$1" dsv3 fc1 wgrad "$2" "$3"
  rm -f "$out/$1_sass.csv"
  grep -E "Warp Cycles Per Issued|No Eligible|stall" "$out/$1_details.txt" | head -12
done
