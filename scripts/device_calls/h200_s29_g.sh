#!/usr/bin/env bash
# Session 29, call G (< 5 min, a fresh machine: empty tuning and auto caches): does the routing the autotuner first
# sees matter? DeepSeek-V3 with skewed:1000 first (as training's first call routes: near-uniform, every expert 201-305
# rows), so the tuner and auto measure on it (and their skewed draw), then balanced and skewed reuse those picks. Call B
# ran skewed:1000 on picks made on balanced routing (256 rows each), as every bench moe run so far.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3 skewed:1000,balanced,skewed 3 1 280 --no-compile > /dev/null
grep -E "rows per expert|over balanced|tuned|grouped_gemm_(fwd|dgrad|wgrad)\|.*(N4096\|K7168|N7168\|K2048)|moe_fc1.*N4096" \
  "$out/deepseek-v3.log"
filter < "$out/deepseek-v3.log" | grep -E "^deep.*(ours \(auto\)|six torch GEMMs)" | grep -v per-expert
