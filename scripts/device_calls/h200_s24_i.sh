#!/usr/bin/env bash
# Session 24, call I (< 5 min): call A again with the tuner's verdicts printed (bench gemm's "tuner:" lines: torch's
# and the pick's times per routing, and the config fastest on the sum): which picks the torch-aware rule changed.
source scripts/device_common.sh "$@"
gpu_test_subset tuner 80 tests/kernels/test_grouped_gemm_gpu.py -k autotuner
run_gemm_bench dsv3 balanced,skewed 200 260
grep -E "tuner:" "$out/gemm_dsv3.log" | head -12
