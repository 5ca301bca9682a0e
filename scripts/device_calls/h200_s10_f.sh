#!/usr/bin/env bash
# Session 10, call F (< 5 min): is the ping-pong weight gradient faster than our Triton kernel at DeepSeek-V3, or only
# under some timing protocols? (The sweep said 1.17x at FC1, the autotuner's own timing 0.94x.) Both kernels under
# four protocols, with the SM clock, power and temperature sampled every 100 ms.
source scripts/device_common.sh "$@"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > "$out/smi.csv" 2>&1 &
smi=$!
for args in "--layer fc1" "--layer fc2" "--layer fc1 --routing skewed"; do
  echo "== $args ($(date +%T))"
  timeout -k 10 100 python3 scripts/wgrad_ab.py --shape dsv3 $args 2>&1 | filter | tail -8
done
kill $smi
python3 - "$out/smi.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))[1:]
clk = [float(r[1].split()[0]) for r in rows if len(r) > 4 and r[1].strip()[0].isdigit()]
pw = [float(r[3].split()[0]) for r in rows if len(r) > 4 and r[3].strip()[0].isdigit()]
print(f"smi samples {len(clk)}: SM clock min {min(clk):.0f} median {sorted(clk)[len(clk)//2]:.0f} max {max(clk):.0f} MHz;"
      f" power median {sorted(pw)[len(pw)//2]:.0f} max {max(pw):.0f} W")
PY
