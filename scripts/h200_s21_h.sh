#!/usr/bin/env bash
# Session 21, call H (< 6 min): the ping-pong weight gradient storing dw from registers, 6-7 stages, against its TMA
# stores with 4-5 (calls E, G: consumers wait on their next tile's data; the tensor pipe idles 28% at DeepSeek-V3's
# FC1). Outputs checked bit for bit first; queued, in turns, with torch.
source scripts/device_common.sh "$@"
timeout -k 10 330 python3 scripts/wgrad_store_bench.py --shapes dsv3,qwen3 --routing balanced,layer-skewed \
  --rounds 3 > "$out/store.log" 2>&1
echo "rc $?"; filter < "$out/store.log" | tail -12
