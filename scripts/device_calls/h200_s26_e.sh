#!/usr/bin/env bash
# Session 26, call E (< 8 min): the fused layer's GPU tests with the row kernels' new programs (call D's run of them
# stopped at its time limit after 17 passed), with the time they need.
source scripts/device_common.sh "$@"
timeout -k 10 420 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_fused_gpu.py \
  tests/kernels/test_moe_layer_triton.py > "$out/tests_layer.log" 2>&1
echo "layer tests rc $?"; grep -E "passed|failed|FAILED|Error" "$out/tests_layer.log" | tail -8; head -c 400 "$out/tests_layer.log"
