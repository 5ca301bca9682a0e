#!/usr/bin/env bash
# Session 21, call E (< 6 min): the ping-pong weight gradient at DeepSeek-V3's FC1 under Nsight Compute (session 9
# profiled the older Triton one: tensor pipe 52%, DRAM 46%). One launch each of ours and torch._grouped_mm, all 256
# experts: the autotuner's usual picks, balanced and skewed routing (sorted there).
source scripts/device_common.sh "$@"
ncu_table() {
  [ -f "$out/$1.ncu-rep" ] || return 0
  "$NCU" -i "$out/$1.ncu-rep" --page raw --csv > "$out/$1_raw.csv" 2>&1
  python3 scripts/ncu_table.py "$out/$1_raw.csv"
  rm -f "$out/$1_raw.csv" "$out/$1_sass.csv"
}
for spec in "wg_bal balanced pingpong/128x128x64/s4/g8" "wg_skew skewed pingpong/128x128x64/s4/g8/sorted" \
            "wg_skew_plain skewed pingpong/128x128x64/s4/g8"; do
  set -- $spec
  ncu_profile "$1" python3 scripts/gemm_anatomy.py --shape dsv3 --layer fc1 --op wgrad --routing "$2" --config "$3" \
    --profile > "$out/$1_headline.txt"
  grep -E "rel err" "$out/$1_headline.txt" | head -2
  ncu_table "$1"
  grep -E "Warp Cycles Per Issued|No Eligible|Stall|stall" "$out/$1_details.txt" | head -12
done
