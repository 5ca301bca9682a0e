#!/usr/bin/env bash
# Session 16, call F (main; < 6.5 min, the last of the device time): FC2 + combine as one autograd node
# (moe_fused.fc2_combine) and the launch-context change on the GPU: the fused layer's GPU tests, the host time (call C:
# Qwen3 1.202 + 2.074 ms, at 4096 tokens 1.136 + 1.842), Qwen3 at 4096 tokens (call C: ours eager 4.26 ms, compiled
# 4.12) and at its own shape (call D: eager 7.93, host-ahead 6.88, graph 7.07, peak 0.95 GiB).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
gpu_test_subset fused_tests 110 tests/kernels/test_moe_fused_gpu.py tests/unit/test_gpu.py -k "not compiled" || exit 1
timeout -k 10 60 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b --calls 20 --tokens 4096 \
  > "$out/host_4096.log" 2>&1
timeout -k 10 50 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b --calls 20 > "$out/host_full.log" 2>&1
grep -hE "^== " "$out/host_4096.log" "$out/host_full.log"
for tokens in 4096 16384; do
  timeout -k 10 75 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes qwen3-30b-a3b \
    --tokens $tokens --routing balanced --reps 5 --warmup 2 --json "$out/qwen3_$tokens.json" > "$out/qwen3_$tokens.log" 2>&1
  filter < "$out/qwen3_$tokens.log" | grep -E "^qwen|Error" | grep -v per-expert | tail -10
done
