#!/usr/bin/env bash
# Next session, call D (< 9.5 min): DeepSeek-V3 and its EP8 rank view (32 local experts, 65536 rows), both routings,
# against every peer including the compiled reference, eager and graphed (session 7's DeepSeek-V3 table lacked the
# compiled reference; the EP8 view was never measured). The floor now frees its outputs one by one and the checked
# graphs are released before timing; expandable segments as in session 7's call G, for comparability.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 560 python3 -m moetrain bench moe --shapes deepseek-v3,deepseek-v3-ep8 --routing balanced,skewed --reps 5 \
  --warmup 2 --backends auto --graphs --json "$out/moe_dsv3.json" 2>&1 | filter | grep -v "^    \[" \
  | grep -E "^deep|Error|error" | tail -40
