#!/usr/bin/env bash
# Session 22, call G (< 2 min): what is cold right after the host waited on the GPU: pure Python, the caching
# allocator, or a kernel launch; after a sync, a timing event's sync, a sleep, a Python spin, and a Python spin on
# event.query() (scripts/host_cold_probe.py, new).
source scripts/device_common.sh "$@"
for ms in 5 20; do
  echo "== wait ${ms} ms"
  timeout -k 10 100 python3 scripts/host_cold_probe.py --wait-ms "$ms" --rounds 40 2>&1 | filter
done
