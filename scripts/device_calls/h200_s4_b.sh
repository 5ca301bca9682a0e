#!/usr/bin/env bash
# Session 4, call B (< 9 min), after refitting the roofline to call A's calibration data: a fresh plan validate
# (out of sample), then the MoE layer at DeepSeek-V3 and Qwen3 (tensor-core router GEMM, auto's routing kernel).
source scripts/device_common.sh "$@"
echo "== graphed contender test (own leaves)"
timeout -k 10 90 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/test_gpu.py -k "graphed or bench_moe_rows" 2>&1 \
  | tee "$out/gpu_graph.log" | grep -E "passed|failed|FAILED|Error" | tail -4
echo "== plan validate"
timeout -k 10 300 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | grep -Ev "Warning|warn" | tail -16
tar czf "$out/validate.tgz" -C "$out" validate && rm -rf "$out/validate"
echo "== MoE layer"
timeout -k 10 200 python3 -m moetrain bench moe --shapes deepseek-v3,qwen3-30b-a3b --routing balanced,skewed --reps 5 --warmup 2 \
  --backends triton,auto --graphs --json "$out/bench_moe.json" 2>&1 | grep -Ev "Warning|warn|softmax|Inductor|important use" \
  | tee "$out/bench_moe.log" | tail -40
