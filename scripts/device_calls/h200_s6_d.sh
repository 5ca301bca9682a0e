#!/usr/bin/env bash
# Session 6, call D (< 8 min): train.cuda_graph now captures the step's update too (norm, clip, skip, AdamW,
# expert bias) and runs on one stream: its GPU tests, the capture step's memory, tiny-wide vs tiny-wide-graph
# projected vs measured; then the DeepSeek-V3 MoE layer under skewed routing (call A's ran past its 150 s, silently).
source scripts/device_common.sh "$@"
echo "== GPU tests: cuda graph, gpu timeline"
timeout -k 10 150 python3 -m pytest -q -m gpu tests/unit/test_cuda_graph_step.py tests/unit/test_gpu_timeline.py \
  -p no:cacheprovider -rf -s 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error|tiny step" | tail -8
echo "== graph memory probe"
timeout -k 10 90 python3 scripts/graph_memory_probe.py 2>&1 | filter | grep -E "^  |Error|error" | head -30
echo "== plan validate, tiny eager and graphed"
timeout -k 10 100 python3 -m moetrain plan validate --configs tiny-wide tiny-wide-graph --out "$out/validate" 2>&1 \
  | filter | tail -6
echo "== MoE layer, DeepSeek-V3 skewed"
timeout -k 10 230 python3 -m moetrain bench moe --shapes deepseek-v3 --routing skewed --reps 5 --warmup 2 \
  --backends triton,auto --json "$out/bench_moe.json" 2>&1 | filter > "$out/bench_moe.log"; grep -v "^    \[" "$out/bench_moe.log" | tail -12; grep "^    \[" "$out/bench_moe.log" | tail -5
