#!/usr/bin/env bash
# Session 24, call E (< 10 min): every GPU test but the compiled ones, after the autotuner began timing
# torch._grouped_mm beside its candidates (the tests that tune at real shapes now time it too).
source scripts/device_common.sh "$@"
gpu_tests 540
