#!/usr/bin/env bash
# Session 15, call B (main; < 4 min): host time of each piece of our eager layer call (scripts/host_breakdown.py)
# at GPT-OSS and Qwen3, the two shapes whose eager time is furthest above their host-ahead time relative to the GPU.
source scripts/device_common.sh "$@"
timeout -k 10 220 python3 scripts/host_breakdown.py --shapes gpt-oss-20b,qwen3-30b-a3b --calls 20 \
  > "$out/host_breakdown.log" 2>&1
filter < "$out/host_breakdown.log" | head -120
