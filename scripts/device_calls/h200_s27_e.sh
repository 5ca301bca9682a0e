#!/usr/bin/env bash
# Session 27, call E (< 9 min): every GPU test but the compiled ones, after the routing kernel's new tile and
# programs (the models' MoE layers route through it, DeepSeek-like ones with expert groups).
source scripts/device_common.sh "$@"
gpu_tests 500
