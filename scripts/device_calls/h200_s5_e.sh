#!/usr/bin/env bash
# Session 5, call E (< 9.5 min): the trainer's step beside the script's on calibration configs, now that the trainer
# reads data ahead (what is left for the roofline's per-step overhead), then the full `plan validate` on this code.
# The validation JSONs are raw measurements: projections can be recomputed from them (compare()) after a refit.
source scripts/device_common.sh "$@"
echo "== calibration with the trainer's own step"
timeout -k 10 230 python3 scripts/plan_calibrate.py --trainer --json "$out/calibrate.json" cal-tiny cal-qwen3-2l \
  cal-qwen3-bf16-s1k cal-llama-2l 2>&1 | filter | cut -c1-220 | tee "$out/calibrate.log" | grep -E "trainer|measured  fwd" | tail -8
echo "== plan validate"
timeout -k 10 300 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | filter | tail -16
tar czf "$out/validate.tgz" -C "$out" validate && rm -rf "$out/validate"
