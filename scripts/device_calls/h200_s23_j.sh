#!/usr/bin/env bash
# Session 23, call J (< 3 min): the direct launcher after it keeps each kernel's trailing parameter values with it
# (one lookup per launch, no per-call rebuild): its GPU tests and the fused layer's.
source scripts/device_common.sh "$@"
gpu_test_subset launch 200 tests/kernels/test_launch_gpu.py tests/kernels/test_moe_fused_gpu.py
