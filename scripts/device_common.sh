# Sourced by the device scripts (scripts/h200_*.sh): the output folder ($1, else $OUT), the repository on the
# Python path, unbuffered output, and `filter` to drop warning noise from what comes back.
# Call with `source scripts/device_common.sh "$@"` from the repository root (where the run tool starts).
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
filter() { grep -Ev "Warning|warn|softmax|Inductor|important use"; }
