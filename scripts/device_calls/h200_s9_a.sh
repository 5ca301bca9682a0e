#!/usr/bin/env bash
# Session 9, call A (< 6 min): where the weight gradient's time goes at DeepSeek-V3 (~450 TF/s, 4 reduction steps
# per tile) against Qwen3 (~620 TF/s, 16 steps): timed against torch._grouped_mm in turns, then one launch of each
# under Nsight Compute (full set, SASS with stall samples), and Qwen3's gathered FC1 forward for the pointer-load path.
source scripts/device_common.sh "$@"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "== ncu: ${NCU:-none}"; [ -n "$NCU" ] && "$NCU" --version | tail -1
echo "== timings (ours 128x256x64/s3/w8/tma vs torch, in turns)"
for args in "--shape dsv3 --layer fc1" "--shape dsv3 --layer fc1 --groups 64" "--shape dsv3 --layer fc2" \
            "--shape qwen3 --layer fc1" "--shape qwen3 --layer fc1 --groups 32"; do
  timeout -k 5 60 python3 scripts/gemm_anatomy.py --op wgrad $args 2>&1 | filter
done
timeout -k 5 60 python3 scripts/gemm_anatomy.py --shape qwen3 --layer fc1 --op fwd_gather --groups 32 2>&1 | filter
timeout -k 5 60 python3 scripts/gemm_anatomy.py --shape qwen3 --layer fc1 --op fwd --groups 32 2>&1 | filter
[ -n "$NCU" ] || exit 0
profile() {  # name, then gemm_anatomy arguments
  local name=$1; shift
  echo "== ncu $name"
  timeout -k 5 150 "$NCU" --profile-from-start off --clock-control none --set full --import-source yes \
    -o "$out/$name" -f python3 scripts/gemm_anatomy.py --profile "$@" 2>&1 | grep -Ev "^==PROF==" | filter | tail -3
  "$NCU" -i "$out/$name.ncu-rep" --page details > "$out/${name}_details.txt" 2>&1
  "$NCU" -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv" 2>&1
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|DRAM Throughput|L2 Hit Rate |Warp Cycles Per Issued|Issued Warp|No Eligible|Registers Per" \
    "$out/${name}_details.txt" | head -40
  wc -c "$out/${name}_sass.csv"
}
profile wgrad_dsv3 --shape dsv3 --layer fc1 --op wgrad --groups 64
profile wgrad_qwen3 --shape qwen3 --layer fc1 --op wgrad --groups 32
profile fwdg_qwen3 --shape qwen3 --layer fc1 --op fwd_gather --groups 32
