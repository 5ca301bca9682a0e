#!/usr/bin/env bash
# Session 10, call J (< 1.5 min): does the slow state after a two-programs-per-SM launch (call I) show under bench
# gemm's protocol (L2 flush before each call, no sync between) and with calls queued back to back, or only when each
# call starts from a synchronized, idle GPU?
source scripts/device_common.sh "$@"
timeout -k 10 80 python3 scripts/wgrad_state.py --shape dsv3 --layer fc1 --protocols \
  --first "fwd:128x128x64/s2/w4/tma/x2" 2>&1 | filter | tail -10
