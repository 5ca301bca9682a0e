#!/usr/bin/env bash
# Session 23, call H (< 3 min): the direct launcher's GPU tests after its key learned the tensors' device kind (a CPU
# tensor goes through Triton, which refuses it), and the fused layer's GPU tests.
source scripts/device_common.sh "$@"
gpu_test_subset launch 200 tests/kernels/test_launch_gpu.py tests/kernels/test_moe_fused_gpu.py
