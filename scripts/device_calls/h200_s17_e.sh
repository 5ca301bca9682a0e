#!/usr/bin/env bash
# Session 17, call E (< 8 min): why eager Mixtral loses 3-4 ms against host-ahead for every layer contender (call D: ours
# 57.80 vs 53.67, the reference 65.05 vs 61.82) but the six-GEMM floor only 0.4 ms (53.10 vs 52.66), more than the
# ~1.2 ms of host time before FC1. Hypothesis: the caching allocator maps pages of its expandable segments inside the
# timed calls (host driver calls that the mallocs column does not count), exposed eagerly and hidden host-ahead. The
# same eager / host-ahead table with and without expandable segments, Mixtral and GPT-OSS.
source scripts/device_common.sh "$@"
eager_table() {  # shape alloc-conf label
  echo "== $1, PYTORCH_CUDA_ALLOC_CONF='$2'"
  PYTORCH_CUDA_ALLOC_CONF="$2" timeout -k 10 110 python3 -m moetrain bench moe --backends auto --no-compile --host-ahead \
    --shapes "$1" --routing balanced --reps 5 --warmup 2 > "$out/$1_$3.log" 2>&1
  filter < "$out/$1_$3.log" | grep -E "^(gpt|mix)|Error" | grep -v per-expert | tail -8
}
eager_table mixtral-8x7b expandable_segments:True expandable
eager_table mixtral-8x7b "" default
eager_table gpt-oss-20b expandable_segments:True expandable
eager_table gpt-oss-20b "" default
