#!/usr/bin/env bash
# Session 10, call G (< 3 min): the autotuner probe (call E: ping-pong 9.2-10.0 ms, Triton 8.7-8.9 at DeepSeek-V3's
# FC1) and the A/B protocols (call F: ping-pong 7.3-7.5, Triton 8.1-9.0) disagreed, on different machines. Here
# both on one GPU, alternated in three processes, with the GPU's identity and clocks.
source scripts/device_common.sh "$@"
nvidia-smi --query-gpu=name,uuid,serial,clocks.max.sm,clocks.max.mem,power.limit --format=csv
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 100 \
  > "$out/smi.csv" 2>&1 &
smi=$!
timeout -k 10 100 python3 scripts/autotune_probe.py --shape dsv3 --layer fc1 2>&1 | filter | tail -20
timeout -k 10 100 python3 scripts/wgrad_ab.py --shape dsv3 --layer fc1 2>&1 | filter | tail -8
timeout -k 10 100 python3 scripts/autotune_probe.py --shape dsv3 --layer fc1 2>&1 | filter | tail -20
kill $smi
