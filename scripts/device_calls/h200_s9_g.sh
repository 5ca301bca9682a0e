#!/usr/bin/env bash
# Session 9, call G (< 3 min, the budget's remainder): why gathered operands load slowly. One launch each under Nsight
# Compute: the weight gradient with x's rows gathered (Qwen3 FC1, 32 experts; ~0.7x torch on the copy in call F) and
# the forward with A rows gathered at DeepSeek-V3 (64 experts; 13% over the TMA forward in session 8).
source scripts/device_common.sh "$@"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
profile() {  # name, then gemm_anatomy arguments
  local name=$1; shift
  echo "== ncu $name"
  timeout -k 5 70 "$NCU" --profile-from-start off --clock-control none --set full --import-source yes \
    -k regex:"_wgrad_kernel|_rowgroup_kernel" -o "$out/$name" -f python3 scripts/gemm_anatomy.py --profile "$@" \
    > "$out/${name}_ncu.log" 2>&1
  "$NCU" -i "$out/$name.ncu-rep" --page details > "$out/${name}_details.txt" 2>&1
  "$NCU" -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv" 2>&1
  rm -f "$out/$name.ncu-rep"
  grep -E "Duration|Compute \(SM\) Throughput|L2 Hit Rate |L1/TEX Hit|Issued Warp Per" "$out/${name}_details.txt" | head -8
}
profile wgradg_qwen3 --shape qwen3 --layer fc1 --op wgrad_gather --groups 32
profile fwdg_dsv3 --shape dsv3 --layer fc1 --op fwd_gather --groups 64
