#!/usr/bin/env bash
# Session 23, call D (< 2 min): the host's time per piece of our layer call, each call behind queued GEMMs (hot, the
# GPU busy) and from an idle GPU (eager): scripts/host_breakdown.py [--queued], Qwen3 and GPT-OSS.
source scripts/device_common.sh "$@"
for run in "--queued" ""; do
  echo "== host_breakdown $run"
  timeout -k 10 200 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b,gpt-oss-20b --calls 20 $run 2>&1 | filter
done
