#!/usr/bin/env bash
# Session 9, call B (< 9.5 min): the weight gradient's new trial configs (32-row steps with 5-6 stages; bands of one
# tile) against torch at DeepSeek-V3 and Qwen3; then the layers with the new host-ahead rows (each eager call behind
# queued GPU work) beside the idle-GPU and graphed ones: is the eager-over-graphed gap the host's start latency?
# (Kept as it ran: the trial configs were dropped after this call, and host-ahead's lead-in is dense GEMMs since call E.)
source scripts/device_common.sh "$@"
echo "== bench test"
timeout -k 10 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/unit/test_gpu.py -k "bench" 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -4
echo "== wgrad trials"
timeout -k 10 170 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --ops wgrad --routing balanced --budget 150 \
  --json "$out/bench_gemm_wgrad.json" > "$out/bench_gemm_wgrad.log" 2>&1
filter < "$out/bench_gemm_wgrad.log" | grep -E "TF/s|auto picked|^dsv3|^qwen3|Error" | tail -20
echo "== layers"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 200 python3 -m moetrain bench moe --shapes deepseek-v3 \
  --routing balanced --reps 5 --warmup 2 --backends auto --graphs --host-ahead --json "$out/moe_dsv3.json" \
  > "$out/moe_dsv3.log" 2>&1
filter < "$out/moe_dsv3.log" | grep -E "^deep|Error" | tail -12
timeout -k 10 130 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced --reps 5 --warmup 2 \
  --backends auto --graphs --host-ahead --json "$out/moe_qwen3.json" > "$out/moe_qwen3.log" 2>&1
filter < "$out/moe_qwen3.log" | grep -E "^qwen|Error" | tail -12
