#!/usr/bin/env bash
# Session 5, call F (< 7 min): a fresh full `plan validate` after the calibration-only refit (STEP_OVERHEAD_S), then
# where the Mixtral / GPT-OSS layers spend their time (auto's choices and a kernel profile; the 3% targets of #6).
source scripts/device_common.sh "$@"
echo "== plan validate"
timeout -k 10 280 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | filter | tail -16
tar czf "$out/validate.tgz" -C "$out" validate && rm -rf "$out/validate"
echo "== MoE layer profile, Mixtral / GPT-OSS (auto)"
timeout -k 10 110 python3 -m moetrain bench moe --shapes mixtral-8x7b,gpt-oss-20b --routing balanced --reps 3 \
  --warmup 1 --backends auto --no-compile --profile 2>&1 | filter > "$out/bench_moe_profile.log"
grep -v "^    " "$out/bench_moe_profile.log" | tail -30
