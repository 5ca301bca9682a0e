#!/usr/bin/env bash
# Session 19, call E (< 6 min; call D's first attempt hung on skewed routing: Triton dropped `steps` from the producer
# loop's carried values, so every tile ran the first tile's step count; now recomputed from the carried rows). The
# ping-pong weight gradient with the producer finding each next tile early (PREFETCH), against the same configs
# without it, queued, DeepSeek-V3 and Qwen3 on both routings. The bench runs only if the GPU tests pass.
source scripts/device_common.sh "$@"
echo "== GPU tests (producer prefetch)"
gpu_test_subset prefetch 90 tests/kernels/test_wgrad_pingpong_gpu.py -k "prefetch" || exit 1
echo "== weight gradients"
timeout -k 10 250 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --rounds 3 --queued \
  --routing balanced,layer-skewed \
  --variants 128x128/s4/g8,128x128/s4/g8/pf,128x128/s4/g8/sorted,128x128/s4/g8/sorted/pf \
  2>&1 | filter | tee "$out/wgrad.log" | grep -v "^  tuned"
