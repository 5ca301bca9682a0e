#!/usr/bin/env bash
# Session 15, call C (main after the host-time changes; < 9.5 min): GPU tests of the changed kernels (the sort with
# the weights in row order and its gradient, the routing backward kernel) and of the fused layer; the host-time
# breakdown again (call B: before); then the layers at GPT-OSS, Qwen3 and DeepSeek-V3 with every peer in the run
# (eager minus host-ahead is the host's latency; call A: Qwen3 7.87 - 7.14 ms).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
gpu_test_subset changed_kernels 220 tests/kernels/test_sort_rows.py tests/kernels/test_route.py \
  tests/kernels/test_moe_fused_gpu.py tests/unit/test_gpu.py -k "not compiled"
timeout -k 10 150 python3 scripts/host_breakdown.py --shapes gpt-oss-20b,qwen3-30b-a3b --calls 20 \
  > "$out/host_breakdown.log" 2>&1
grep -E "^== " "$out/host_breakdown.log"
run_bench() {  # shape routing reps warmup timeout
  timeout -k 10 "$5" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes "$1" --routing "$2" \
    --reps "$3" --warmup "$4" --json "$out/$1.json" > "$out/$1.log" 2>&1
  filter < "$out/$1.log" | grep -E "^(deep|gpt|qwen)|Error" | grep -v per-expert | tail -12
}
run_bench gpt-oss-20b balanced 7 2 100
run_bench qwen3-30b-a3b balanced 5 2 80
run_bench deepseek-v3 balanced 5 2 200
