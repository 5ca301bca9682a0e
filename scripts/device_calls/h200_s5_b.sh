#!/usr/bin/env bash
# (As run. The host probe it calls, moetrain/plan/host.py, was removed after call D: it did not track host-bound steps.)
# Session 5, call B (< 9.5 min): this host's eager speed (plan.host probe) beside host-bound and GPU-bound steps:
# calibration with the trainer's own step (cal-tiny is host-bound; the rest look for the roofline's ~10% low bias on
# fp32-main-grad configs), three validation configs (the workers record the probe), the MoE layer at DeepSeek-V3.
source scripts/device_common.sh "$@"
probe() { python3 -c "from moetrain.plan.host import probe_us; print(f'host probe {probe_us():.1f} us')"; }
echo "== host"; probe; nproc; grep -m1 "model name" /proc/cpuinfo
echo "== calibration with the trainer's own step"
timeout -k 10 210 python3 scripts/plan_calibrate.py --trainer --json "$out/calibrate.json" cal-tiny cal-qwen3-2l \
  cal-qwen3-bf16-s1k cal-llama-2l 2>&1 | filter | cut -c1-220 | tee "$out/calibrate.log" | grep -v "^    layer\|^    head" | tail -22
probe
echo "== plan validate, three configs"
timeout -k 10 130 python3 -m moetrain plan validate --configs tiny-wide qwen3-4l qwen3-bf16-state --out "$out/validate" \
  2>&1 | filter | tail -8
probe
echo "== MoE layer, DeepSeek-V3"
timeout -k 10 170 python3 -m moetrain bench moe --shapes deepseek-v3 --routing balanced,skewed --reps 5 \
  --warmup 2 --backends triton,auto --json "$out/bench_moe.json" 2>&1 | filter | grep -v "^    " | tee "$out/bench_moe.log" | tail -24
