#!/usr/bin/env bash
# Session 23, call A (< 2 min): which part of a Triton launch is slow after the host waited on the GPU: the launch,
# or the driver's pointer checks Triton's launcher makes per pointer argument (scripts/launch_cold_probe.py, new).
source scripts/device_common.sh "$@"
for ms in 5 20; do
  echo "== wait ${ms} ms"
  timeout -k 10 120 python3 scripts/launch_cold_probe.py --wait-ms "$ms" --rounds 40 2>&1 | filter
done
