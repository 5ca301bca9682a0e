#!/usr/bin/env bash
# Session 20, call I (< 4 min): the other GPU tests that run the autotuner and auto (now timing queued): the trainer's
# CUDA-graph step (tunes before capture), the GPU timeline, and the sort kernels.
source scripts/device_common.sh "$@"
gpu_test_subset rest 200 tests/unit/test_cuda_graph_step.py tests/unit/test_gpu_timeline.py \
  tests/kernels/test_sort_rows.py -k "not compiled"
