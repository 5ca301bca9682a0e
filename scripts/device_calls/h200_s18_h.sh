#!/usr/bin/env bash
# Session 18, call H (< 3 min): would DeepSeek-V3's light groups overlap its heavy ones as a second launch on another
# stream? (call A: a one-step tile stores dw at 86% of dw.zero_()'s rate; in one launch the two kinds run in step.)
source scripts/device_common.sh "$@"
echo "== weight gradient, heavy and light groups split into two launches"
timeout -k 10 200 python3 scripts/wgrad_split_streams.py --shapes dsv3,qwen3 --light 64,128 --splits 24,40,66 \
  2>&1 | filter | tail -12
