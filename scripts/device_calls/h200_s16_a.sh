#!/usr/bin/env bash
# Session 16, call A (branch s16 = main + next/route-aux; < 9.5 min): the routing kernels with the aux-loss sums on the
# GPU (plain pytest: these files are not marked gpu), an eager training run of a reduced qwen3-30b-a3b preset (its
# router's batch aux loss now comes from the routing kernel), every other GPU test (session 15's review refactors
# touched the GPU tests' float64 checks and the fused layer's backward), then Qwen3's kernel table and host-time
# breakdown as this session's baseline.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== route / sort tests"
timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_route.py tests/kernels/test_sort_rows.py \
  > "$out/route_tests.log" 2>&1; tail -3 "$out/route_tests.log"
echo "== train qwen3-30b-a3b (2 layers, seq 2048, eager, moe.backend=triton)"
timeout -k 10 120 python3 -m moetrain train --preset qwen3-30b-a3b model.num_layers=2 train.seq_length=2048 \
  train.micro_batch_size=2 train.global_batch_size=2 train.steps=20 optim.warmup_steps=5 optim.lr=3e-4 \
  moe.backend=triton checkpoint.save_final=false train.log_interval=5 train.out_dir="$out/qwen3" \
  > "$out/train.log" 2>&1; filter < "$out/train.log" | tail -8
echo "== GPU tests"
gpu_tests 280
echo "== Qwen3 kernel table (eager, auto)"
timeout -k 10 100 python3 -m moetrain bench moe --backends auto --no-compile --profile --shapes qwen3-30b-a3b \
  --routing balanced --reps 3 --warmup 2 > "$out/qwen3_profile.log" 2>&1
filter < "$out/qwen3_profile.log" | grep -E "^qwen|Error" | grep -v per-expert | tail -6
echo "== host breakdown"
timeout -k 10 90 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b --calls 20 > "$out/host_breakdown.log" 2>&1
grep -E "^== " "$out/host_breakdown.log"
