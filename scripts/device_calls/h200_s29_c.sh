#!/usr/bin/env bash
# Session 29, call C (< 10 min): Qwen3 and GPT-OSS on balanced and four skewed concentrations (as call A ran
# DeepSeek-V3), every peer but the compiled reference, in one process per shape.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for shape in qwen3-30b-a3b gpt-oss-20b; do
  run_bench $shape balanced,skewed:1000,skewed:10,skewed:1,skewed 5 2 280 --no-compile > /dev/null
  grep -E "rows per expert|over balanced" "$out/$shape.log"
  filter < "$out/$shape.log" | grep -E "^(qwen|gpt).*(ours \(auto\)|six torch GEMMs)" | grep -v per-expert
done
