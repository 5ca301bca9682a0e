#!/usr/bin/env bash
# Session 28, call A (< 9.5 min): the SwiGLU kernels load each row block's probs once per program instead of once per
# column step: their tests on the GPU and their sweep against torch and the copy ceiling; the routing programs at the
# small expert counts (Mixtral's 8, GPT-OSS's 32: never swept); then where the eager call's host time goes now
# (host_breakdown, eager_gaps: last measured in sessions 21-23, before the direct launches and sessions 24-27).
source scripts/device_common.sh "$@"
kernel_tests tests_rows_route 200 tests/kernels/test_moe_rows.py tests/kernels/test_route.py
echo "== swiglu, qwen3 and gpt-oss"
row_sweep sweep_swiglu 100 --shapes qwen3-30b-a3b,gpt-oss-20b --kernels swiglu_fwd,swiglu_bwd --rounds 5
echo "== route at 8 and 32 experts"
row_sweep sweep_route_small 100 --shapes mixtral-8x7b,gpt-oss-20b --kernels route,route_bwd --rounds 5
echo "== host breakdown, eager and queued"
timeout -k 10 90 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b,gpt-oss-20b --calls 20 2>&1 | filter \
  | tee "$out/host_eager.txt" | head -70
timeout -k 10 60 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b --calls 20 --queued 2>&1 | filter \
  | tee "$out/host_queued.txt" | head -40
echo "== eager gaps"
(cd scripts && timeout -k 10 90 python3 eager_gaps.py --shapes qwen3-30b-a3b,gpt-oss-20b --calls 7 2>&1 | filter \
  | tee "$out/eager_gaps.txt" | head -80)
