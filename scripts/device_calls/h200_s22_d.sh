#!/usr/bin/env bash
# Session 22, call D (< 9 min): the six grouped GEMMs of DeepSeek-V3's EP8 rank view against torch._grouped_mm,
# both routings (every config, then torch, our best and auto in turns); last swept in session 15, before the
# autotuner timed its candidates queued (session 20).
source scripts/device_common.sh "$@"
run_gemm_bench dsv3-ep8 balanced,skewed 330 540
