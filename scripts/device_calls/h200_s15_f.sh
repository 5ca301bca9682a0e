#!/usr/bin/env bash
# Session 15, call F (main; < 9.5 min): the router GEMM's bf16-out data gradient (its GPU tests), Qwen3's layer with it
# (calls C, D: graph 1.11 of the floor), then auto's per-op choice against torch at the shapes call E did not cover
# (GPT-OSS, Mixtral, DeepSeek-V3's EP8 view).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
gpu_test_subset router_tests 120 tests/unit/test_gpu.py -k "router or sync_free"
timeout -k 10 110 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes qwen3-30b-a3b \
  --routing balanced --reps 7 --warmup 2 --json "$out/qwen3.json" > "$out/qwen3.log" 2>&1
filter < "$out/qwen3.log" | grep -E "^qwen|Error" | grep -v per-expert | tail -12
timeout -k 5 300 python3 -m moetrain bench gemm --shapes gptoss,dsv3-ep8,mixtral --routing balanced --budget 200 \
  > "$out/gemm.log" 2>&1
filter < "$out/gemm.log" | grep -E "^(gptoss|mixtral|dsv3)|six" | tail -24
