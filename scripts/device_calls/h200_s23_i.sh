#!/usr/bin/env bash
# Session 23, call I (< 2 min): the direct launcher's GPU tests after it refuses a parameter left to its default.
source scripts/device_common.sh "$@"
gpu_test_subset launch 150 tests/kernels/test_launch_gpu.py
