#!/usr/bin/env bash
# Next session, call A (< 9.5 min): GPU tests (the 256-row configs are now autotuner candidates); the grouped GEMM
# sweep at DeepSeek-V3 and Qwen3, both routings (#6: ours >= 1.1x torch over the six GEMMs, auto >= 1.0x per op);
# the DeepSeek-V3 layer under skew (session 5's call B ran out of time on the per-expert loop, fixed since).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 170
echo "== grouped GEMMs"
timeout -k 10 230 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --ops fwd,dgrad,wgrad --routing balanced,skewed \
  --budget 200 --json "$out/bench_gemm.json" 2>&1 | filter | tee "$out/bench_gemm.log" | grep -v "^    " | tail -30
echo "== MoE layer, DeepSeek-V3 skewed"
timeout -k 10 150 python3 -m moetrain bench moe --shapes deepseek-v3 --routing skewed --reps 5 --warmup 2 \
  --backends triton,auto --json "$out/bench_moe.json" 2>&1 | filter > "$out/bench_moe.log"; grep -v "^    " "$out/bench_moe.log" | tail -24
