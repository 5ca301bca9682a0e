#!/usr/bin/env bash
# Session 15, call G (main; < 4 min, what is left of the device time): Qwen3 and GPT-OSS at 4096 tokens per layer call
# (`bench moe --tokens 4096`): a quarter of the GPU work of the default shapes and the same host work, every peer in
# the run, eager against host-ahead and graphed.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for shape in qwen3-30b-a3b gpt-oss-20b; do
  timeout -k 10 105 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes $shape --tokens 4096 \
    --routing balanced --reps 5 --warmup 2 --json "$out/$shape.json" > "$out/$shape.log" 2>&1
  filter < "$out/$shape.log" | grep -E "^(qwen|gpt)|Error" | grep -v per-expert | tail -11
done
