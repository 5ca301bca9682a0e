#!/usr/bin/env bash
# Session 14, call A (branch s14/trial = main + next/swiglu-bwd-prefetch + next/skew-tuning; < 9.5 min):
# 1. the SwiGLU-backward epilogue with a quarter tile's g and u loaded at once: its GPU tests, then the fused data
#    gradient against the separate pairs at Qwen3 and GPT-OSS (session 13 call H: fused 1.455 / 2.831 ms against the
#    plain ping-pong pair 1.260 / 2.398 and torch's 0.983 / 2.170);
# 2. the autotuner judging each config on the caller's routing plus a skewed one: the grouped GEMM GPU tests, then
#    Qwen3's layer on balanced and skewed routing (session 13 call C: 1.35 eager / 1.24 graphed of its floor, skewed
#    +17.3%; session 11, before the ping-pong forward / data gradient: skewed +12% eager, +10.4% graphed);
# 3. the layer's kernels at Qwen3 (torch.profiler, auto, balanced): what is left besides the GEMMs.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== 1. SwiGLU backward prefetch"
gpu_test_subset swiglu_tests 60 tests/kernels/test_rowgroup_pingpong_gpu.py -k "swiglu_backward"
timeout -k 5 80 python3 scripts/fc2_dgrad_swiglu_bench.py --shapes qwen3,gptoss --rounds 3 --stages 5 \
  > "$out/fc2_swiglu.log" 2>&1
filter < "$out/fc2_swiglu.log" | tail -4
echo "== 2. skew-aware tuning: grouped GEMM GPU tests"
gpu_test_subset gemm_tests 90 tests/kernels/test_grouped_gemm_gpu.py
echo "== bench moe qwen3-30b-a3b"
timeout -k 10 170 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes qwen3-30b-a3b \
  --reps 5 --warmup 2 --json "$out/qwen3.json" > "$out/qwen3.log" 2>&1
filter < "$out/qwen3.log" | grep -E "^qwen|Error|tuned|skew" | grep -v per-expert | tail -14
echo "== 3. profile qwen3 balanced (auto)"
timeout -k 10 90 python3 -m moetrain bench moe --backends auto --no-compile --profile --shapes qwen3-30b-a3b \
  --routing balanced --reps 3 --warmup 1 > "$out/qwen3_profile.log" 2>&1
filter < "$out/qwen3_profile.log" | grep -A30 "ours (auto): " | head -24
