#!/usr/bin/env bash
# Session 27, call G (< 3 min): the route kernels' scores as one shared jit function (_scores): the route tests on
# the GPU.
source scripts/device_common.sh "$@"
kernel_tests tests_route 150 tests/kernels/test_route.py
