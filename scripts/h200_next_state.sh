#!/usr/bin/env bash
# Next session, first call (< 8 min): (1) call J of session 10: is the ping-pong weight gradient slow under bench
# gemm's protocol and under queued calls after a two-programs-per-SM launch, or only when each call starts from an
# idle GPU? (2) the DeepSeek-V3 layer twice, in two processes: as shipped, and with the autotuner timing queued
# batches (scripts/bench_moe_queued_tuning.py); each process has every peer, so compare ratios, not raw ms.
source scripts/device_common.sh "$@"
echo "== state under three protocols"
timeout -k 10 80 python3 scripts/wgrad_state.py --shape dsv3 --layer fc1 --protocols \
  --first "fwd:128x128x64/s2/w4/tma/x2" 2>&1 | filter | tail -10
n=0
for variant in "python3 -m moetrain bench moe" "python3 scripts/bench_moe_queued_tuning.py"; do
  n=$((n + 1))
  echo "== layer: $variant"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 180 $variant --shapes deepseek-v3 \
    --routing balanced --reps 5 --warmup 2 --backends auto --graphs --host-ahead > "$out/layer$n.log" 2>&1
  filter < "$out/layer$n.log" | grep -E "^deep|Error|tuned wgrad|queued" | tail -16
done
