#!/usr/bin/env bash
# Session 16, call E (main; < 9 min, the last of the device time): the final code's layers at GPT-OSS and Mixtral with
# every peer in the run (call C had them without the compiled reference and the graphs).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench() {  # shape routing reps warmup timeout
  timeout -k 10 "$5" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes "$1" --routing "$2" \
    --reps "$3" --warmup "$4" --json "$out/$1.json" > "$out/$1.log" 2>&1
  filter < "$out/$1.log" | grep -E "^(deep|gpt|qwen|mix)|Error" | grep -v per-expert | tail -12
}
run_bench gpt-oss-20b balanced 7 2 200
run_bench mixtral-8x7b balanced 3 1 260
