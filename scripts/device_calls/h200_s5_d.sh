#!/usr/bin/env bash
# (As run. The host probe it calls, moetrain/plan/host.py, was removed after call D: it did not track host-bound steps.)
# Session 5, call D (< 9.5 min): the host probe in each context of the trainer's process, then the full
# `plan validate` (12 configs, 20 steps, fresh process each) on the session-5 code: data read ahead in the trainer,
# measured blocks with the main-grad hooks, launches charged at the worker host's probed speed.
source scripts/device_common.sh "$@"
echo "== host probe by context"
timeout -k 10 40 python3 scripts/host_probe_context.py 2>&1 | filter
echo "== plan validate"
timeout -k 10 500 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | filter | tail -18
python3 scripts/host_probe_context.py 2>&1 | filter | head -1
