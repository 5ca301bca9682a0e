#!/usr/bin/env bash
# Next session, call A (< 8 min): every GPU test (the plain forward's scheduling moved into shared jit helpers in
# session 7, after its last full GPU run; the FC1 + SwiGLU kernel's paired variant is new), the fp32 FC1 + SwiGLU
# module on CUDA, then both FC1 + SwiGLU variants alone against plain forward + SwiGLU kernel per config.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 200
timeout -k 5 90 python3 -m pytest -q tests/kernels/test_fc1_swiglu.py -p no:cacheprovider -rf 2>&1 | tail -3
for shape in mixtral-8x7b qwen3-30b-a3b; do
  echo "== $shape: FC1 + SwiGLU alone"
  timeout -k 5 90 python3 scripts/fc1_swiglu_alone.py --shape $shape --gather --rounds 3 2>&1 | filter | head -16
done
