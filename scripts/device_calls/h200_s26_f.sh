#!/usr/bin/env bash
# Session 26, call F (< 3 min): Qwen3's layer kernel by kernel with the row kernels' new programs (session 24 F's
# command): the GPU time per call of every kernel, eager and graphed, and the three ways' wall times.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 170 python3 scripts/graph_vs_eager.py --shapes qwen3-30b-a3b --routing balanced --calls 3 --reps 3 \
  --top 40 > "$out/graph_vs_eager.log" 2>&1; echo "rc $?"
filter < "$out/graph_vs_eager.log" | head -75
