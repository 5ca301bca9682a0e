#!/usr/bin/env bash
# Session 29, call B (< 10 min): Mixtral's layer on both routings with every peer and 15 repetitions, where sessions
# 16-28 ran 3 (its ratios to the floor moved 4-5 points between runs of 3; a repetition is ~60 ms a contender, the
# set-up dominates). Then DeepSeek-V3 on balanced (round-robin: exactly 256 rows per expert) and skewed:1000 (shares
# ~uniform: rows per expert 201-305, the noise of random top-k), no compiled reference: call A found the layer and the
# six torch GEMMs 16-28% over balanced at every concentration, mild ones included.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench mixtral-8x7b balanced,skewed 15 1 380
grep -E "rows per expert|over balanced" "$out/mixtral-8x7b.log"
run_bench deepseek-v3 balanced,skewed:1000 3 1 190 --no-compile > /dev/null
grep -E "rows per expert|over balanced" "$out/deepseek-v3.log"
filter < "$out/deepseek-v3.log" | grep -E "^deep.*(ours \(auto\)|six torch GEMMs|reference eager)" | grep -v per-expert
