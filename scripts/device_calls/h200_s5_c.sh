#!/usr/bin/env bash
# Next session, call C (< 8 min): the grouped GEMM sweep at every shape, both routings, the 256-row configs on trial
# included (promote them in grouped_gemm_tuning.py if they win and test_bf16_trial_configs_on_skewed_routing passed).
source scripts/device_common.sh "$@"
timeout -k 10 420 python3 -m moetrain bench gemm --shapes dsv3,qwen3,dsv3-ep8,mixtral,gptoss --ops fwd,dgrad,wgrad \
  --routing balanced,skewed --budget 330 --json "$out/bench_gemm.json" 2>&1 \
  | filter | tee "$out/bench_gemm.log" | grep -v "^    " | tail -45
