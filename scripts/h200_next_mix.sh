#!/usr/bin/env bash
# Next session, first call (~2 min; written in session 11, whose device time ran out first): the ping-pong's "mix"
# schedule (groups heaviest first; on skewed routing half the programs walk backwards). GPU tests (bitwise equal to
# the plain schedule, float64), then DeepSeek-V3's two weight gradients on balanced, bench moe's skewed and
# Dirichlet-skewed routing, in turns.
source scripts/device_common.sh "$@"
echo "== GPU tests"
timeout -k 5 50 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_wgrad_pingpong_gpu.py \
  -k "mix or cohorts" > "$out/mix_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error|Timeout" "$out/mix_tests.log" | tail -6
grep -q "failed\|Timeout" "$out/mix_tests.log" && exit 1
echo "== timing"
timeout -k 5 75 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3 --rounds 3 \
  --routing balanced,layer-skewed,skewed --variants 128x128/s4/g8,128x128/s4/g8/c2,128x128/s4/g8/mix \
  > "$out/mix_bench.log" 2>&1
filter < "$out/mix_bench.log" | tail -8
