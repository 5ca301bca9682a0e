#!/usr/bin/env bash
# Session 21, call G (< 3 min): where the ping-pong weight gradient's warps stall at DeepSeek-V3's FC1 (balanced),
# instruction by instruction (call E: tensor pipe idle 28%; barriers 34% and shared-memory scoreboards 32% of the
# consumers' stalls). One launch of ours only, Nsight Compute's SASS page with stall samples.
source scripts/device_common.sh "$@"
[ -n "$NCU" ] || { echo "no ncu"; exit 0; }
timeout -k 5 150 "$NCU" --profile-from-start off --clock-control none -k regex:_wgrad_pingpong \
  --section SourceCounters --section WarpStateStats --import-source yes -o "$out/wg" -f \
  python3 scripts/gemm_anatomy.py --shape dsv3 --layer fc1 --op wgrad --routing balanced \
  --config pingpong/128x128x64/s4/g8 --profile 2>&1 | grep -Ev "^==PROF==" | filter | tail -3
"$NCU" -i "$out/wg.ncu-rep" --page source --csv --print-source sass > "$out/wg_sass.csv" 2>&1
python3 scripts/ncu_stalls.py "$out/wg_sass.csv" --top 45
