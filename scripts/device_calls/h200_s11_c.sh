#!/usr/bin/env bash
# Session 11, call C (< 8 min). Is the ping-pong's "process state" the GPU's clocks? nvidia-smi logs SM clock, power,
# temperature and throttle reasons every 100 ms into $out/clocks.csv while (1) wgrad_state.py repeats call A's
# protocols around one two-programs-per-SM launch and (2) the layer runs with its weight gradients forced to each
# config in turns (scripts/layer_wgrad_ab.py): does the ping-pong make the layer faster where the autotuner rejected it?
source scripts/device_common.sh "$@"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 100 > "$out/clocks.csv" 2>&1 &
smi=$!
echo "== state (timestamps for the clock log)"
date +%s.%N
timeout -k 10 90 python3 scripts/wgrad_state.py --shape dsv3 --layer fc1 --protocols \
  --first "fwd:128x128x64/s2/w4/tma/x2" 2>&1 | filter | while IFS= read -r line; do echo "$(date +%s.%N) $line"; done \
  | tee "$out/state.log" | tail -9
echo "== layer with forced weight-gradient configs"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 200 python3 scripts/layer_wgrad_ab.py \
  --shapes deepseek-v3,qwen3-30b-a3b --reps 9 > "$out/layer_ab.log" 2>&1
filter < "$out/layer_ab.log" | grep -vE "^\s+\[" | tail -30
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 120 python3 scripts/layer_wgrad_ab.py \
  --shapes deepseek-v3 --routing skewed --reps 7 > "$out/layer_ab_skewed.log" 2>&1
filter < "$out/layer_ab_skewed.log" | grep -vE "^\s+\[" | tail -14
kill $smi
python3 - "$out/clocks.csv" <<'PY'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 5]
sm = [float(r[1].split()[0]) for r in rows if r[1].split()[0].replace(".", "").isdigit()]
print(f"clock log: {len(rows)} samples, SM MHz min {min(sm):.0f} median {sorted(sm)[len(sm)//2]:.0f} max {max(sm):.0f}")
PY
