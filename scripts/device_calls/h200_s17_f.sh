#!/usr/bin/env bash
# Session 17, call F (< 5.5 min): auto now times the fused path's FC1 variants on relabeled tokens too (a trained
# router's token order; the balanced routing's favoured gathers through L2). The fused path's GPU tests (auto's
# measurement, CUDA-graph replays), then Qwen3's layer on both routings with every peer (call B: host-ahead +8.7%,
# graphed +10.8% skewed over balanced, auto having picked the gather for FC1's forward).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
gpu_test_subset fused 130 tests/kernels/test_moe_fused_gpu.py
echo "== Qwen3 layer, balanced and skewed"
run_bench qwen3-30b-a3b balanced,skewed 5 2 200
python3 - "$out/qwen3-30b-a3b.json" <<'PY'
import json, sys
from moetrain.ops import autoselect
for key, e in autoselect.entries().items():
    if key.startswith("moe_fc1"):
        print(key.split("|")[0], e["backend"], autoselect.describe_times(e["ms"]))
PY
