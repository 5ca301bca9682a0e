#!/usr/bin/env bash
# Session 17, call A (< 9.5 min): session 16's model loss terms on the GPU (a shared zero for a loss that is off, the
# MoE layers' aux terms in one stack + sum; unit GPU tests, eager and graphed training runs of a reduced qwen3
# preset), then where Qwen3's skewed routing costs time: the layer's kernel table on both routings and the six GEMMs
# per op on both (ours and torch).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== unit GPU tests (trainer, graphed step, router, bench)"
gpu_test_subset unit 200 tests/unit/test_gpu.py tests/unit/test_cuda_graph_step.py tests/unit/test_models_moe.py
train() {  # name extra-overrides...
  local name=$1; shift
  echo "== train qwen3-30b-a3b 2 layers ($name)"
  timeout -k 10 120 python3 -m moetrain train --preset qwen3-30b-a3b model.num_layers=2 train.seq_length=2048 \
    train.micro_batch_size=2 train.global_batch_size=2 train.steps=20 optim.warmup_steps=5 optim.lr=3e-4 \
    checkpoint.save_final=false train.log_interval=5 train.out_dir="$out/$name" "$@" > "$out/train_$name.log" 2>&1
  filter < "$out/train_$name.log" | tail -6
}
train eager
train graphed train.cuda_graph=true
echo "== Qwen3 kernel tables, balanced and skewed (eager, auto)"
timeout -k 10 150 python3 -m moetrain bench moe --backends auto --no-compile --profile --shapes qwen3-30b-a3b \
  --routing balanced,skewed --reps 3 --warmup 2 > "$out/qwen3_profile.log" 2>&1
filter < "$out/qwen3_profile.log" | grep -A16 "ours (auto):" | head -40
filter < "$out/qwen3_profile.log" | grep -E "^qwen|Error" | grep -v per-expert | tail -8
echo "== six GEMMs, Qwen3, both routings"
timeout -k 10 150 python3 -m moetrain bench gemm --shapes qwen3 --routing balanced,skewed --budget 120 \
  > "$out/gemm.log" 2>&1
filter < "$out/gemm.log" | grep -B2 -A24 "^shape" | head -60
