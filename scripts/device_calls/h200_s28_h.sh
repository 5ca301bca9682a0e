#!/usr/bin/env bash
# Session 28, call H (< 7 min): the six GEMMs at the EP8 rank view, GPT-OSS and Mixtral on both routings (last in
# session 24 C, where auto's EP8 FC1 data gradient read 0.99 of torch).
source scripts/device_common.sh "$@"
for shape in dsv3-ep8 gptoss mixtral; do
  echo "== bench gemm, $shape"
  run_gemm_bench $shape balanced,skewed 100 130
done
