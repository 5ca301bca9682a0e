#!/usr/bin/env bash
# Session 10, call H (< 2 min): which weight-gradient config, run once, leaves the ping-pong kernel slow for the rest
# of the process (call G)?
source scripts/device_common.sh "$@"
timeout -k 10 150 python3 scripts/wgrad_state.py --shape dsv3 --layer fc1 2>&1 | filter | tail -20
