"""What `moetrain bench moe` prints after its table: each contender's skewed over balanced time, and what backend
"auto" and the autotuner chose. Plain functions of the table's rows and of the on-disk caches."""

from __future__ import annotations


def skew_summary(rows: list[dict]) -> list[str]:
    """One line per shape timed on both routings: each contender's skewed time over its balanced time (#6 asks
    ours to stay within 10%), from bench rows (run_shape's dicts)."""
    ms = {(r["shape"], r["routing"], r["contender"]): r["ms"] for r in rows}
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        cells = [f"{name} {100 * (ms[(shape, 'skewed', name)] / t - 1):+.1f}%"
                 for (s, routing, name), t in ms.items()
                 if s == shape and routing == "balanced" and (shape, "skewed", name) in ms]
        if cells:
            lines.append(f"{shape}: skewed over balanced: " + ", ".join(cells))
    return lines


def print_auto_choices() -> None:
    """What backend="auto" chose for each GEMM it measured (the on-disk cache), with its timings."""
    from moetrain.ops import autoselect

    print(f"\nauto's choices ({autoselect.cache_path()}):", flush=True)
    for key, entry in sorted(autoselect.entries().items()):
        print(f"  {key:60s} -> {entry['backend']:7s} ({autoselect.describe_times(entry['ms'])} ms)", flush=True)
    if autoselect.triton_available():  # the tile config each of our kernels ran with (what "triton" above means)
        from moetrain.kernels.grouped_gemm_tuning import tuned_configs

        for key, cfg in sorted(tuned_configs().items(), key=str):
            print(f"  tuned {'|'.join(str(k) for k in key[:1] + key[3:6]):40s} {cfg}", flush=True)
