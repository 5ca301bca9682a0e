# Sourced by the device scripts (scripts/h200_*.sh): the output folder ($1, else $OUT), the repository on the
# Python path, unbuffered output, `filter` to drop warning noise from what comes back, and `gpu_tests SECONDS`.
# Call with `source scripts/device_common.sh "$@"` from the repository root (where the run tool starts).
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
filter() { grep -Ev "Warning|warn|softmax|Inductor|important use"; }
# Every GPU test but the torch.compile ones (their own call: a hang there once cost 9 minutes), killed after SECONDS
# (-k: a hung CUDA process ignores SIGTERM); the log goes to $out/gpu_tests.log, the summary lines to stdout.
gpu_tests() {
  timeout -k 10 "$1" python3 -m pytest -q -m gpu tests -p no:cacheprovider -rf -k "not compiled" 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error|tiny step" | tail -8
}
