#!/usr/bin/env bash
# Session 22, call E (< 5 min): is the eager call's cold host (each op 3-15x its hot cost right after a sync) the
# process moving between CPUs? Qwen3's eager gaps unpinned, then pinned to one CPU (taskset), then unpinned again.
source scripts/device_common.sh "$@"
cd scripts
for pin in "" "taskset -c 3" ""; do
  echo "== pinned: ${pin:-no}"
  timeout -k 10 120 $pin python3 eager_gaps.py --shapes qwen3-30b-a3b --calls 7 2>&1 | filter | grep -E "^==|before the first|router_logits|launch _route|fc1_swiglu"
done
