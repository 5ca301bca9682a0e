#!/usr/bin/env bash
# Session 21, call D (< 7 min): zero-padded A rows in the forward / data gradient (a ragged A descriptor: a group's
# last tile reads zeros past the group's end, not the next group's rows). Call A: the skewed forward spends 1.28x the
# balanced MMA work (padding) and the benchmarks run at the board's power cap; MMAs on zeros draw less power and
# the TMA reads no bytes for them. (1) GPU tests: the trial configs (bf16 vs fp64, skewed routing) and z against
# plain bit for bit; (2) queued, in turns, with torch and the autotuner's pick, z or not, both kernels.
source scripts/device_common.sh "$@"
gpu_test_subset zero 200 tests/kernels/test_grouped_gemm_gpu.py -k "zero or (trial_configs and (fwd or dgrad))"
v=128x256x64/s3/w8/tma,128x256x64/s3/w8/tma/z,pingpong/128x128x64/s5/g8,pingpong/128x128x64/s5/g8/z
echo "== DeepSeek-V3"
timeout -k 10 240 python3 scripts/rowgroup_pingpong_bench.py --shapes dsv3 --rounds 3 --queued \
  --routing balanced,skewed,layer-skewed --variants "$v" > "$out/dsv3.log" 2>&1
echo "rc $?"; filter < "$out/dsv3.log" | tail -16
echo "== Qwen3"
timeout -k 10 150 python3 scripts/rowgroup_pingpong_bench.py --shapes qwen3 --rounds 3 --queued \
  --routing balanced,layer-skewed --variants "$v" > "$out/qwen3.log" 2>&1
echo "rc $?"; filter < "$out/qwen3.log" | tail -12
