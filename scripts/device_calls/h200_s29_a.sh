#!/usr/bin/env bash
# Session 29, call A (< 10 min): DeepSeek-V3's layer on balanced routing and on skewed routings from four Dirichlet
# concentrations (10, 3, 1 and #6's 0.3, from mildest to most uneven: a run cut short keeps the milder ones), every
# peer but the compiled reference in the same process: how the layer's time and the six torch GEMMs' grow with the
# imbalance (the log's routing lines give each routing's max / mean rows per expert and CV).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3 balanced,skewed:10,skewed:3,skewed:1,skewed 3 1 585 --no-compile > /dev/null
grep -E "rows per expert|over balanced" "$out/deepseek-v3.log"
filter < "$out/deepseek-v3.log" | grep -E "^deep.*(ours \(auto\)|six torch GEMMs|reference eager)" | grep -v per-expert
