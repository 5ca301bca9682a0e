#!/usr/bin/env bash
# Session 21, call C (< 5 min): where the eager layer call's GPU waits on the host, marker by marker (CUDA events and
# host clock readings at chosen functions and every launch; the same call host-ahead gives each segment's GPU work).
# Eager over host-ahead: Qwen3 1.28 against 1.09, GPT-OSS 1.04 against 0.99 (session 20).
source scripts/device_common.sh "$@"
cd scripts
timeout -k 10 200 python3 eager_gaps.py --shapes qwen3-30b-a3b,gpt-oss-20b --calls 7 > "$out/gaps.log" 2>&1
echo "rc $?"; filter < "$out/gaps.log" | tail -80
timeout -k 10 100 python3 eager_gaps.py --shapes qwen3-30b-a3b --tokens 4096 --calls 7 > "$out/gaps4096.log" 2>&1
echo "rc $?"; filter < "$out/gaps4096.log" | tail -40
