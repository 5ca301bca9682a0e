#!/usr/bin/env bash
# Session 6, call F (< 5 min): the full `plan validate` (14 configs, tiny-wide-graph and qwen3-4l-graph included) with
# the final code: STEP_OVERHEAD_GRAPH_S fitted on call E's calibration configs, a host none of them ran on.
source scripts/device_common.sh "$@"
timeout -k 5 265 python3 -m moetrain plan validate --steps 16 --out "$out/validate" 2>&1 | filter | tail -20
