#!/usr/bin/env bash
# One device call: environment, GPU tests, `moetrain train` on tiny and on a reduced
# qwen3-30b-a3b, then the training-step benchmark against HF transformers.
# Usage on the GPU machine, from the repo root: bash scripts/device_calls/h200_train_check.sh [OUT_DIR]
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

echo "== GPU tests"
python3 -m pytest -q -m gpu tests/unit/test_gpu.py -p no:cacheprovider 2>&1 | tail -15

echo "== moetrain train (tiny, bf16)"
python3 -m moetrain train train.device=cuda train.out_dir="$out/tiny" 2>&1 | tail -14

echo "== moetrain train (qwen3-30b-a3b, 4 layers, seq 4096, bf16)"
python3 -m moetrain train --preset qwen3-30b-a3b model.num_layers=4 train.seq_length=4096 \
  train.micro_batch_size=2 train.global_batch_size=2 train.steps=30 optim.warmup_steps=5 optim.lr=3e-4 \
  checkpoint.save_final=false train.log_interval=10 train.out_dir="$out/qwen3" 2>&1 | tail -16

echo "== training step vs HF transformers (same process)"
python3 -m moetrain.bench.train_step --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 30 \
  --json "$out/train_step_qwen3.json" 2>&1 | tail -12
