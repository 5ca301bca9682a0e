#!/usr/bin/env bash
# (As it ran in session 8; scripts/swiglu_fusion_alone.py went with the fusions after this call: see git history.)
# Next session, call A (< 7 min): every GPU test (the plain forward's scheduling moved into shared jit helpers in
# session 7 after its last full GPU run; the SwiGLU fusions' bf16 tests: FC1 paired and two-accumulator, FC2's
# data gradient, the layer with each fusion and its CUDA-graph replay), then Mixtral's SwiGLU fusions alone against
# the plain kernels, every config (scripts/swiglu_fusion_alone.py).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 200
echo "== mixtral-8x7b: SwiGLU fusions alone"
timeout -k 5 180 python3 scripts/swiglu_fusion_alone.py --shape mixtral-8x7b --gather --rounds 3 2>&1 | filter | head -70
