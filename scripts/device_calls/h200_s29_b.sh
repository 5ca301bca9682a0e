#!/usr/bin/env bash
# Session 29, call B (< 10 min, after A on its warm machine): Mixtral's layer on both routings with every peer and 15
# repetitions, where sessions 16-28 ran 3 (its ratios to the floor moved 4-5 points between runs of 3; a repetition is
# ~60 ms a contender, the set-up dominates). Then Qwen3's layer on the milder skewed routings (no compiled reference).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench mixtral-8x7b balanced,skewed 15 1 400
grep -E "rows per expert|over balanced" "$out/mixtral-8x7b.log"
run_bench qwen3-30b-a3b balanced,skewed:10,skewed:3,skewed:1,skewed 5 2 170 --no-compile > /dev/null
grep -E "rows per expert|over balanced" "$out/qwen3-30b-a3b.log"
filter < "$out/qwen3-30b-a3b.log" | grep -E "^qwen.*(ours \(auto\)|six torch GEMMs|reference eager)" | grep -v per-expert
