#!/usr/bin/env bash
# Session 14, call G (main; < 3 min, the device time left): the SwiGLU row kernels' tile width (fewest masked lanes;
# Qwen3's I = 768 takes 256 columns instead of 1024): the row-kernel tests on the GPU (bf16), then the kernels with
# either tile width in turns (call F: the SwiGLU backward took 0.335 ms at Qwen3, ~3.0 TB/s).
source scripts/device_common.sh "$@"
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_rows.py 2>&1 | tail -2
timeout -k 5 90 python3 scripts/swiglu_tile_bench.py --shapes qwen3,gptoss,mixtral,dsv3 --rounds 7 2>&1 | filter
