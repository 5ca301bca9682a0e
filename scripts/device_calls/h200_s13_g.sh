#!/usr/bin/env bash
# Session 13, call G: after splitting the fused FC1 + SwiGLU into two autograd nodes (h freed after SwiGLU's
# backward): the layer's GPU tests, then Mixtral's and GPT-OSS's layers with every peer (peaks).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset layer_tests 150 tests/kernels/test_moe_fused_gpu.py tests/kernels/test_rowgroup_pingpong_gpu.py \
  -k "not compiled and (fused or auto or fc1_with_swiglu or graph)"
for spec in "mixtral-8x7b 3 1 220" "gpt-oss-20b 5 2 160"; do
  set -- $spec
  echo "== $1"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 "$4" python3 -m moetrain bench moe --backends auto \
    --graphs --host-ahead --shapes "$1" --routing balanced --reps "$2" --warmup "$3" > "$out/$1.log" 2>&1
  filter < "$out/$1.log" | grep -E "^(mixtral|gpt-oss)|moe_fc1_swiglu" | grep -v "per-expert" | tail -12
done
