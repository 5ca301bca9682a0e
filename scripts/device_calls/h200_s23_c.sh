#!/usr/bin/env bash
# Session 23, call C (< 3 min): where the host's hot time goes in our layer call (cProfile, each call behind queued
# GEMMs: scripts/host_profile_moe.py --queued, new), Qwen3 at 16384 and 4096 tokens; the eager calls for comparison.
source scripts/device_common.sh "$@"
for run in "--queued" "--queued --tokens 4096" ""; do
  name=$(echo "hot$run" | tr -d ' -')
  timeout -k 10 170 python3 scripts/host_profile_moe.py --shapes qwen3-30b-a3b --calls 20 --top 30 $run 2>&1 | filter \
    > "$out/$name.txt"
  echo "== $run"; grep "^==" "$out/$name.txt"
done
