#!/usr/bin/env bash
# Session 12, call B: the ping-pong forward / data gradient (kernels/rowgroup_pingpong.py) on the GPU for the first
# time: its GPU tests (float64 on skewed routing, trailing rows, torch at the layer shapes), then its variants against
# torch._grouped_mm and our tuned Triton kernel at every layer shape's four forward / data-gradient GEMMs.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset rowgroup_pp_tests 150 tests/kernels/test_rowgroup_pingpong_gpu.py || exit 1
echo "== forward / data gradient, balanced"
timeout -k 5 300 python3 scripts/rowgroup_pingpong_bench.py --shapes dsv3,qwen3,gptoss,mixtral --rounds 3 \
  --variants 128x128/s4/g8,128x128/s5/g8,64x256/s3/g8,64x256/s4/g8 > "$out/rg_bench.log" 2>&1
filter < "$out/rg_bench.log" | tail -20
echo "== skewed"
timeout -k 5 100 python3 scripts/rowgroup_pingpong_bench.py --shapes dsv3,qwen3 --routing skewed --rounds 3 \
  --variants 128x128/s4/g8,64x256/s3/g8 > "$out/rg_skew.log" 2>&1
filter < "$out/rg_skew.log" | tail -12
