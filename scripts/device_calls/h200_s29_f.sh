#!/usr/bin/env bash
# Session 29, call F (< 10 min): every GPU test but the compiled ones (last full run: session 27 E; session 28 ran the
# row, routing and fused-layer tests after its kernel changes), with bench moe's new routing names.
source scripts/device_common.sh "$@"
gpu_tests 560
