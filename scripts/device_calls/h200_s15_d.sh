#!/usr/bin/env bash
# Session 15, call D (main; < 8 min): the routing and sort kernel tests on the GPU (not marked gpu: they run on CUDA
# when there is one, and call C's `-m gpu` left them out); Mixtral on both routings (session 14 call E: eager /
# host-ahead / graph 1.08 / 1.01 / 1.04 of its floor balanced), then Qwen3 and GPT-OSS skewed.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_route.py \
  tests/kernels/test_sort_rows.py > "$out/route_sort_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$out/route_sort_tests.log" | tail -5
run_bench() {  # shape routing reps warmup timeout
  timeout -k 10 "$5" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes "$1" --routing "$2" \
    --reps "$3" --warmup "$4" --json "$out/$1.json" > "$out/$1.log" 2>&1
  filter < "$out/$1.log" | grep -E "^(mix|gpt|qwen)|Error|over balanced" | grep -v per-expert | tail -22
}
run_bench mixtral-8x7b balanced,skewed 3 1 250
run_bench qwen3-30b-a3b balanced,skewed 5 2 110
