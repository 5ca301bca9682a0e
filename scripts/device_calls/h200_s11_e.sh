#!/usr/bin/env bash
# Session 11, call E (< 9.5 min): the autotuner without the two-programs-per-SM configs (now on trial). GPU tests of
# the grouped GEMM (every trial config, x2 included, on skewed routing), then `bench moe` as in session 10's table
# (DeepSeek-V3, Qwen3, EP8 balanced and skewed; GPT-OSS and Mixtral with their compiled reference), and the
# DeepSeek-V3 layer with forced weight-gradient configs beside auto's new pick. Each step under its own timeout.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== GPU tests (grouped GEMM)"
timeout -k 10 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_grouped_gemm_gpu.py \
  > "$out/tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$out/tests.log" | tail -4
bench() {  # NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  echo "== bench moe $name"
  timeout -k 10 "$limit" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --json "$out/$name.json" \
    "$@" > "$out/$name.log" 2>&1
  filter < "$out/$name.log" | grep -E "^(deep|qwen|mixtral|gpt)|Error|tuned wgrad" | grep -v "per-expert" | tail -24
}
bench dsv3 150 --shapes deepseek-v3 --reps 5 --warmup 2
bench qwen3 90 --shapes qwen3-30b-a3b --reps 5 --warmup 2
echo "== layer, forced weight gradients"
timeout -k 10 70 python3 scripts/layer_wgrad_ab.py --shapes deepseek-v3 --reps 7 > "$out/layer_ab.log" 2>&1
filter < "$out/layer_ab.log" | grep -vE "^\s+\[" | tail -13
bench ep8 80 --shapes deepseek-v3-ep8 --reps 5 --warmup 2
bench gptoss 70 --shapes gpt-oss-20b --routing balanced --reps 5 --warmup 2
