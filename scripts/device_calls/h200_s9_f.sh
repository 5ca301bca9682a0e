#!/usr/bin/env bash
# Session 9, call F (< 5 min): the gathered weight gradient's 5-stage trial configs (the index and the rows in
# separate stages, 2 groups in flight; 3-4 stages kept one): their bf16 GPU test, then every wgrad and wgrad_gather
# config against torch at DeepSeek-V3, its EP8 view and Qwen3, and the x_perm copy that the gather saves.
# (Kept as it ran: the 5-stage trial configs were dropped after this call, so its test selection now finds no test
# and the sweep times the usual configs only.)
source scripts/device_common.sh "$@"
echo "== trial GPU tests"
timeout -k 10 80 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_grouped_gemm_gpu.py \
  -k "trial and wgrad_gather" > "$out/gpu_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -4
echo "== the copy the gather saves (x.index_select(0, perm), median ms)"
timeout -k 5 40 python3 - <<'PY' 2>&1 | filter
import torch
from moetrain.kernels.timing import median_ms
for name, m, k in (("dsv3 fc1", 65536, 7168), ("qwen3 fc1", 131072, 2048)):
    x = torch.randn(m // 8, k, device="cuda", dtype=torch.bfloat16)
    rows = torch.randint(0, m // 8, (m,), device="cuda")
    print(f"  {name}: x_perm [{m}, {k}] gather {median_ms(lambda: x.index_select(0, rows), warmup=3, reps=10):.3f} ms")
PY
echo "== wgrad vs wgrad_gather"
timeout -k 10 200 python3 -m moetrain bench gemm --shapes dsv3,dsv3-ep8,qwen3 --ops wgrad,wgrad_gather --routing balanced \
  --budget 170 --json "$out/bench_gemm.json" > "$out/bench_gemm.log" 2>&1
filter < "$out/bench_gemm.log" | grep -E "^\[|^\s+[0-9]+x|^dsv3|^qwen3|WRONG|FAILED" | grep -v "fc2" | tail -30
