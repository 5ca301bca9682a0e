#!/usr/bin/env bash
# Session 6, call C (< 8 min): where the CUDA-graph capture step's extra memory comes from (tiny-wide-graph measured
# 0.41 GiB on the capture step, 0.20 on replays, 0.31 projected), then the full `plan validate` (13 configs) with the
# roofline's router fix (its forward was scaled again into the elementwise backward).
source scripts/device_common.sh "$@"
echo "== graph memory probe"
timeout -k 10 90 python3 scripts/graph_memory_probe.py 2>&1 | filter | grep -E "^  |Error|error" | head -40
echo "== plan validate"
timeout -k 10 400 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | filter | tail -20
tar czf "$out/validate.tgz" -C "$out" validate && rm -rf "$out/validate"
