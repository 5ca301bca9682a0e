#!/usr/bin/env bash
# Next session, call C (< 9 min), if train.cuda_graph passed its GPU tests in call A: a training step with and without
# the graph (Qwen3 at 4 layers, in one process), then the full `plan validate` (13 configs, tiny-wide-graph included).
source scripts/device_common.sh "$@"
echo "== training step, eager vs CUDA graph"
timeout -k 10 200 python3 -m moetrain bench train --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 16 \
  --warmup 5 --no-peer --cuda-graph 2>&1 | filter | tail -6
echo "== plan validate"
timeout -k 10 320 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | filter | tail -18
tar czf "$out/validate.tgz" -C "$out" validate && rm -rf "$out/validate"
