#!/usr/bin/env bash
# Session 24, call F (< 5 min): Qwen3's layer kernel by kernel (balanced routing; eager, host-ahead and graphed in
# turns, then each kernel's GPU time per call): what its time over the six GEMMs' floor is made of now.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 280 python3 scripts/graph_vs_eager.py --shapes qwen3-30b-a3b --routing balanced --calls 3 --reps 3 \
  --top 40 2>&1 | filter
