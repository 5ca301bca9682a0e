#!/usr/bin/env bash
# Session 22, call B (< 8 min): where DeepSeek-V3's skewed layer runs slower eager than graphed (bench moe: eager
# 37.76, host-ahead 37.43, graph 36.65 ms in session 21): kernel by kernel (scripts/graph_vs_eager.py, new), then
# the eager call's GPU idle per host step (scripts/eager_gaps.py --routing skewed).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 300 python3 scripts/graph_vs_eager.py --shapes deepseek-v3 --routing skewed --calls 2 --reps 5 2>&1 | filter
cd scripts && timeout -k 10 150 python3 eager_gaps.py --shapes deepseek-v3 --routing skewed --calls 5 2>&1 | filter | head -40
