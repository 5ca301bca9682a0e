#!/usr/bin/env bash
# Next session, call B (< 8 min): train.cuda_graph on the tiny configs (plan validate: eager vs graphed, projected vs
# measured; the GPU tests of call A check the graphed trainer against the eager one), then where a host-bound trainer
# step spends the ~15 ms that the same step without the trainer's loop does not (plan_calibrate --trainer, session 5:
# cal-tiny 64.9 vs 49.6 ms): profiler traces of two trainer steps (CPU + CUDA activity), tiny (host-bound) and a
# 2-layer Qwen3 (GPU-bound), gzipped for reading here.
source scripts/device_common.sh "$@"
echo "== plan validate, tiny eager and graphed"
timeout -k 10 90 python3 -m moetrain plan validate --configs tiny-wide tiny-wide-graph --out "$out/validate" 2>&1 | filter | tail -6
common=(train.steps=8 train.log_interval=8 train.eval_interval=0 checkpoint.save_final=false profile.enabled=true
        profile.start_step=6 profile.end_step=7)
timeout -k 10 120 python3 -m moetrain train --preset tiny train.micro_batch_size=8 train.global_batch_size=8 \
  train.seq_length=64 "${common[@]}" train.out_dir="$out/run_tiny" 2>&1 | filter | tail -2
timeout -k 10 150 python3 -m moetrain train --preset qwen3-30b-a3b model.num_layers=2 train.seq_length=2048 \
  train.micro_batch_size=2 train.global_batch_size=2 "${common[@]}" train.out_dir="$out/run_qwen3" 2>&1 | filter | tail -2
find "$out" -name "trace_*.json" -exec gzip {} \;
find "$out" -name "*.ckpt" -o -name "*.safetensors" | xargs -r rm -f
ls -la "$out"/run_*/profile/
echo "== the Mixtral layer's wall time vs its kernels (timeline per contender)"
timeout -k 10 110 python3 -m moetrain bench moe --shapes mixtral-8x7b --routing balanced --reps 3 --warmup 1 \
  --backends auto --no-compile --profile 2>&1 | filter | grep -E "timeline|ms of kernels|^mixtral" | cut -c1-400
