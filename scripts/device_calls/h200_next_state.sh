#!/usr/bin/env bash
# Next session, first call (< 9 min). Session 10 found the ping-pong weight gradient ~27% slower for the rest of a
# process after one launch of any two-programs-per-SM grouped GEMM config (bench/NOTES.md). (1) Is it slow under
# bench gemm's protocol and under queued calls too, or only when each call starts from an idle GPU? With fewer
# programs than SMs? After 2 s idle? (2) One launch before and one after, under Nsight Compute. (3) The DeepSeek-V3
# layer twice, in two processes: as shipped, and with the autotuner timing queued batches
# (scripts/bench_moe_queued_tuning.py); each process has every peer, so compare ratios, not raw ms.
source scripts/device_common.sh "$@"
echo "== state under three protocols"
timeout -k 10 90 python3 scripts/wgrad_state.py --shape dsv3 --layer fc1 --protocols --probes \
  --first "fwd:128x128x64/s2/w4/tma/x2" 2>&1 | filter | tail -14
ncu_profile state python3 scripts/wgrad_state.py --shape dsv3 --layer fc1 --profile --first "fwd:128x128x64/s2/w4/tma/x2"
n=0
for variant in "python3 -m moetrain bench moe" "python3 scripts/bench_moe_queued_tuning.py"; do
  n=$((n + 1))
  echo "== layer: $variant"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 170 $variant --shapes deepseek-v3 \
    --routing balanced --reps 5 --warmup 2 --backends auto --graphs --host-ahead > "$out/layer$n.log" 2>&1
  filter < "$out/layer$n.log" | grep -E "^deep|Error|tuned wgrad|queued" | tail -16
done
