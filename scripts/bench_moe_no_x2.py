"""`moetrain bench moe` with every two-programs-per-SM config removed from the grouped GEMM autotuner's candidates:
one launch of such a config left the ping-pong weight gradient ~27% slower for the rest of the process (session 10,
call H), so the autotuner, timing after it, rejected the ping-pong kernel. An experiment, not a product setting; since
session 11 the autotuner has no such candidates (grouped_gemm_tuning.TWO_PER_SM_CONFIGS are on trial), so this is
plain `bench moe` now, kept as the record of session 10's call I.

    python scripts/bench_moe_no_x2.py --shapes deepseek-v3 --routing balanced ...   (bench moe's arguments)
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from moetrain import cli
    from moetrain.kernels import grouped_gemm as gg

    gg.ROWGROUP_CONFIGS = tuple(c for c in gg.ROWGROUP_CONFIGS if c.programs_per_sm == 1)
    gg.WGRAD_CONFIGS = tuple(c for c in gg.WGRAD_CONFIGS if c.programs_per_sm == 1)
    print("candidates without two programs per SM:", len(gg.ROWGROUP_CONFIGS), "row-group,", len(gg.WGRAD_CONFIGS),
          "weight-gradient", flush=True)
    return cli.main(["bench", "moe", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
