#!/usr/bin/env bash
# Next session, call B (< 4 min): why auto picked torch for five of six Qwen3 GEMMs where ours was 3-12% faster
# (session 6): the sweep now prints auto's own timing per backend and the config the autotuner gave its triton run.
source scripts/device_common.sh "$@"
timeout -k 10 200 python3 -m moetrain bench gemm --shapes qwen3,dsv3 --ops fwd,dgrad,wgrad --routing balanced \
  --budget 120 --json "$out/bench_gemm.json" 2>&1 | filter | tee "$out/bench_gemm.log" | grep -E "auto picked|TF/s|layer|^qwen3|^dsv3" | tail -40
# DeepSeek-V3 balanced: where our layer's time goes besides its GEMMs (timeline lines in full: runtime calls)
timeout -k 10 200 python3 -m moetrain bench moe --shapes deepseek-v3 --routing balanced --reps 3 --warmup 1 \
  --backends auto --no-compile --profile 2>&1 | filter | grep -v "^    \[" | tail -40
