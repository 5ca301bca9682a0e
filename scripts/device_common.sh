# Sourced by one-off device call scripts (the ignored scripts/device_calls/; older ones in git history):
# the output folder ($1, else $OUT), the repository
# on the Python path, unbuffered output, `filter` to drop warning noise from what comes back, `gpu_tests SECONDS`,
# `gpu_test_subset NAME SECONDS PYTEST_ARGS...`, `kernel_tests`, `row_sweep`, `run_bench`, `run_gemm_bench` (below).
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
# pytest killed after SECONDS: `pytest_to_log NAME SECONDS PYTEST_ARGS...`, its output to $out/NAME.log; returns
# pytest's exit status (124 / 137: timed out).
pytest_to_log() {
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" python3 -m pytest -q -p no:cacheprovider -rf "$@" > "$out/$name.log" 2>&1
}
# Some GPU tests, killed after SECONDS: `gpu_test_subset NAME SECONDS PYTEST_ARGS...`; the log goes to $out/NAME.log,
# the summary lines to stdout; returns non-zero when a test failed or the run timed out (a hang: a barrier bug).
gpu_test_subset() {
  local name=$1; pytest_to_log "$@" -m gpu
  local rc=$?
  grep -E "passed|failed|FAILED|Error|Timeout" "$out/$name.log" | tail -6
  [ "$rc" -eq 0 ] || { echo "== $name: pytest exit $rc"; return 1; }
}
# Every test of some kernel test files (they run on the GPU when there is one, unmarked), killed after SECONDS:
# `kernel_tests NAME SECONDS FILES...`; the log goes to $out/NAME.log, the summary lines to stdout.
kernel_tests() {
  local name=$1; pytest_to_log "$@"
  echo "$name rc $?"; grep -E "passed|failed|FAILED|Error" "$out/$name.log" | tail -12
}
# The row kernels' sweep: `row_sweep NAME SECONDS ARGS...` (scripts/row_kernel_sweep.py's arguments); its JSON goes to
# $out/NAME.json, its table to stdout.
row_sweep() {
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" python3 scripts/row_kernel_sweep.py "$@" --json "$out/$name.json" 2>&1 | filter
  echo "$name rc $?"
}
# Nsight Compute, when the machine has it: `ncu_profile NAME COMMAND...` profiles the launches COMMAND brackets with
# cudaProfilerStart/Stop (full set, SASS with stall samples, clocks left alone) into $out/NAME.ncu-rep, writes the
# details page and the SASS page (CSV) beside it, and prints the headline metrics of each kernel.
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
ncu_profile() {
  local name=$1; shift
  [ -n "$NCU" ] || { echo "== ncu_profile $name: no ncu on this machine"; return 0; }
  echo "== ncu $name"
  timeout -k 5 150 "$NCU" --profile-from-start off --clock-control none --set full --import-source yes \
    -o "$out/$name" -f "$@" 2>&1 | grep -Ev "^==PROF==" | filter | tail -3
  "$NCU" -i "$out/$name.ncu-rep" --page details > "$out/${name}_details.txt" 2>&1
  "$NCU" -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv" 2>&1
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|DRAM Throughput|L2 Hit Rate |Warp Cycles Per Issued|Issued Warp|No Eligible|Registers Per" \
    "$out/${name}_details.txt" | head -40
}
# `ncu_table NAME`: scripts/ncu_table.py's metrics per kernel of $out/NAME.ncu-rep (its raw page, then deleted: the
# run tool brings back a limited number of files).
ncu_table() {
  [ -n "$NCU" ] && [ -f "$out/$1.ncu-rep" ] || return 0
  "$NCU" -i "$out/$1.ncu-rep" --page raw --csv > "$out/$1_raw.csv" 2>&1
  python3 scripts/ncu_table.py "$out/$1_raw.csv"
  rm -f "$out/$1_raw.csv"
}
# `ncu_gemm NAME SHAPE LAYER OP ROUTING CONFIG`: one launch of ours (CONFIG) and one of torch._grouped_mm under
# ncu_profile (scripts/gemm_anatomy.py --profile), the headline page to $out/NAME_headline.txt, then ncu_table.
ncu_gemm() {
  local name=$1
  ncu_profile "$name" python3 scripts/gemm_anatomy.py --shape "$2" --layer "$3" --op "$4" --routing "$5" --config "$6" \
    --profile > "$out/${name}_headline.txt"
  grep -E "rel err" "$out/${name}_headline.txt" | head -2
  ncu_table "$name"
}
# The layer benchmark with every peer: `run_bench SHAPE ROUTING REPS WARMUP SECONDS [MORE BENCH ARGS...]`; JSON and log
# go to $out/SHAPE.json / .log, the table rows to stdout. (Session 15 and 16 scripts define their own copy.)
run_bench() {
  local shape=$1 routing=$2 reps=$3 warmup=$4 limit=$5; shift 5
  timeout -k 10 "$limit" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes "$shape" \
    --routing "$routing" --reps "$reps" --warmup "$warmup" --json "$out/$shape.json" "$@" > "$out/$shape.log" 2>&1
  filter < "$out/$shape.log" | grep -E "^(deep|gpt|qwen|mix)|Error" | grep -v per-expert | tail -24
}
# The six GEMMs' sweep: `run_gemm_bench SHAPE ROUTING BUDGET SECONDS`; the log goes to $out/gemm_SHAPE.log, auto's
# picks and the table rows to stdout.
run_gemm_bench() {
  local shape=$1 routing=$2 budget=$3 limit=$4
  timeout -k 10 "$limit" python3 -m moetrain bench gemm --shapes "$shape" --routing "$routing" --budget "$budget" \
    > "$out/gemm_$shape.log" 2>&1
  echo "rc $?"; filter < "$out/gemm_$shape.log" | grep -E "^$shape|^layer|auto picked" | tail -16
}
