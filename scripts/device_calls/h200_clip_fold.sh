#!/usr/bin/env bash
# Session 11, call D (from branch next/eager-clip-fold, merged after it; < 9.5 min): the eager step's clip folded into the fused
# AdamW. Calibration first (STEP_OVERHEAD_S, the trainer's step beside the script's on configs that are not
# validation configs), then the full validate; pins in tests/plan/h200_measured.py to be refreshed from these.
source scripts/device_common.sh "$@"
echo "== calibration (trainer vs script step)"
timeout -k 10 200 python3 scripts/plan_calibrate.py --trainer cal-qwen3-2l cal-qwen3-bf16-s1k cal-llama-2l \
  --json "$out/calibrate.json" 2>&1 | filter | grep -E "trainer|step|cal-" | tail -20
echo "== plan validate"
timeout -k 10 330 python3 -m moetrain plan validate --steps 16 --out "$out/validate" 2>&1 | filter | tail -20
tar czf "$out/validate.tgz" -C "$out" validate && rm -rf "$out/validate"
