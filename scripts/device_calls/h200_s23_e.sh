#!/usr/bin/env bash
# Session 23, call E (< 9 min): direct kernel launches (kernels/launch.py, new). The GPU tests (the launcher's own,
# then every GPU test but the compiled ones: all of our kernels now launch through it), then the host's time per piece
# of the layer call with Triton's launches and direct ones in turn, queued and eager (host_breakdown.py; Qwen3 and
# GPT-OSS; call D timed Triton's before).
source scripts/device_common.sh "$@"
gpu_test_subset launch 300 tests/kernels/test_launch_gpu.py || exit 1
gpu_tests 400
timeout -k 10 60 python3 -m pytest -q tests/kernels/test_route.py tests/kernels/test_sort_rows.py -p no:cacheprovider 2>&1 \
  | tail -2
for run in "--queued" ""; do
  name=breakdown$(echo "$run" | tr -d ' -')
  echo "== host_breakdown $run (all of it in $name.txt)"
  timeout -k 10 200 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b,gpt-oss-20b --calls 20 \
    --launches triton,direct,triton,direct $run 2>&1 | filter > "$out/$name.txt"
  grep -E "^==|forward: (moe_experts|route|router_logits|sort_rows|fc1_swiglu) " "$out/$name.txt"
done
