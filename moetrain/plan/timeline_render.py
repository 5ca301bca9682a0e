"""Draw pipeline timelines: one panel per timeline, stacked, on one time axis.

``render(timelines, path)`` writes ``.png`` (matplotlib, imported lazily) or ``.html`` (one self-contained page with
an inline SVG: no scripts, no fonts, no external files). Per rank one row: forward, backward and weight-gradient
ops coloured (later chunks of a rank lighter), the micro-batch number inside an op where it fits, idle time inside
the step grey; on the right the rank's idle share and peak memory. Each panel is titled with its source, schedule,
pp / vpp, micro-batches and step time. Pure Python apart from matplotlib.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from moetrain.errors import UserError
from moetrain.plan.timeline import Timeline

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}
NAMES = {"F": "forward", "B": "backward (input gradient; whole backward where no W follows)", "W": "weight gradient"}
IDLE = "#D0D0D0"
FORMATS = (".png", ".html")


def check_output(path: str) -> str:
    """The output format of ``path`` (its extension), or UserError naming the valid ones."""
    ext = Path(path).suffix.lower()
    if ext not in FORMATS:
        raise UserError(f"--out {path}: unknown extension {ext or '(none)'!r}; use .png or .html")
    return ext


def render(timelines: list[Timeline], path: str) -> None:
    if check_output(path) == ".png":
        render_png(timelines, path)
    else:
        Path(path).write_text(render_html(timelines))


# ---- shared -------------------------------------------------------------------------------------------------------

def time_unit(seconds: float) -> tuple[str, float]:
    """(unit, scale) so that ``seconds * scale`` reads well: s, ms or us."""
    if seconds >= 1.0:
        return "s", 1.0
    return ("ms", 1e3) if seconds >= 1e-3 else ("us", 1e6)


def shade(color: str, chunk: int, vpp: int) -> str:
    """``color`` mixed with white: chunk 0 as is, the last chunk 40% white."""
    if vpp <= 1:
        return color
    mix = 0.4 * chunk / (vpp - 1)
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02X}" for c in rgb)


def title(tl: Timeline) -> str:
    unit, scale = time_unit(tl.step_time)
    where = f"{tl.source} {tl.label}".strip() + (f" (step {tl.step})" if tl.step is not None else "")
    return (f"{where}: {tl.schedule}, pp={tl.pp} vpp={tl.vpp}, {tl.micro_batches} micro-batches, "
            f"step {tl.step_time * scale:.3g} {unit}")


def rank_note(tl: Timeline, r: int) -> str:
    mem = tl.peak_mem(r)
    return f"idle {tl.bubble_fraction(r):.1%}, " + ("peak ? GiB" if mem is None else f"peak {mem:.1f} GiB")


def nice_ticks(end: float, count: int = 8) -> list[float]:
    if end <= 0:
        return [0.0]
    raw = end / count
    base = 10 ** math.floor(math.log10(raw))
    step = next(k * base for k in (1, 2, 5, 10) if k * base >= raw)
    return [i * step for i in range(int(end / step) + 1)]


# ---- PNG --------------------------------------------------------------------------------------------------------

def render_png(timelines: list[Timeline], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise UserError("drawing a PNG needs matplotlib (pip install matplotlib); --out FILE.html or --json "
                        "need nothing") from None
    end = max(tl.step_time for tl in timelines) or 1.0
    unit, scale = time_unit(end)
    heights = [1.2 + 0.4 * tl.pp for tl in timelines]
    width_in = 14.0
    fig, axes = plt.subplots(len(timelines), 1, figsize=(width_in, sum(heights) + 0.6), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    px_per_unit = width_in * 0.78 * 120 / (end * scale)  # the axes span ~78% of the figure at 120 dpi
    for ax, tl in zip(axes[:, 0], timelines):
        _panel_png(ax, tl, scale, px_per_unit)
        ax.set_xlim(0, end * scale)
    axes[-1, 0].set_xlabel(unit)
    handles = [Patch(color=COLORS[k], label=k + ": " + NAMES[k]) for k in COLORS] + [Patch(color=IDLE, label="idle")]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.86, 1 - 0.45 / (sum(heights) + 0.6)))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _panel_png(ax, tl: Timeline, scale: float, px_per_unit: float) -> None:
    for r, ops in enumerate(tl.ranks):
        ax.broken_barh([((a * scale), (b - a) * scale) for a, b in tl.gaps(r)], (r - 0.4, 0.8), color=IDLE)
        by_color: dict[str, list] = {}
        for op in ops:
            by_color.setdefault(shade(COLORS[op.kind], op.chunk, tl.vpp), []).append(
                (op.start * scale, (op.end - op.start) * scale))
        for color, spans in by_color.items():
            ax.broken_barh(spans, (r - 0.4, 0.8), color=color, edgecolor="white", linewidth=0.3)
        for op in ops:
            if (op.end - op.start) * scale * px_per_unit >= 7 * len(str(op.mb)) + 3:
                ax.text((op.start + op.end) / 2 * scale, r, str(op.mb), ha="center", va="center", fontsize=6,
                        color="white")
        ax.annotate(rank_note(tl, r), xy=(1.005, r), xycoords=("axes fraction", "data"), va="center", fontsize=8)
    ax.set_yticks(range(tl.pp))
    ax.set_yticklabels([f"pp{r}" for r in range(tl.pp)])
    ax.set_ylim(tl.pp - 0.5, -0.5)
    ax.set_title(title(tl), fontsize=9, loc="left")


# ---- HTML (inline SVG) --------------------------------------------------------------------------------------------

ROW, GAP, LEFT, RIGHT, WIDTH = 18, 4, 48, 190, 1200


def render_html(timelines: list[Timeline]) -> str:
    """One self-contained page: an inline SVG with one ``rect`` per op (class "op F|B|W") and per idle interval
    (class "bubble"), each with a tooltip."""
    end = max(tl.step_time for tl in timelines) or 1.0
    unit, scale = time_unit(end)
    plot_w = WIDTH - LEFT - RIGHT
    x = lambda t: LEFT + t / end * plot_w  # noqa: E731
    parts, y = [], 8
    parts.append(_legend_svg(y))
    y += 26
    for tl in timelines:
        parts.append(f'<text x="{LEFT}" y="{y + 12}" class="title">{html.escape(title(tl))}</text>')
        y += 20
        for r in range(tl.pp):
            parts += _row_svg(tl, r, y, x, scale, unit)
            y += ROW + GAP
        parts += _axis_svg(y, x, end, scale, unit)
        y += 34
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y}" viewBox="0 0 {WIDTH} {y}">\n'
           '<style>text{font:11px sans-serif;fill:#222}.title{font-weight:bold}.mb{font-size:9px;fill:#fff}'
           '.note{font-size:10px}</style>\n' + "\n".join(parts) + "\n</svg>")
    names = ", ".join(html.escape(f"{tl.source} {tl.label}".strip()) for tl in timelines)
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>pipeline timeline: " + names +
            "</title></head>\n<body style=\"margin:12px;background:#fff\">\n" + svg + "\n</body></html>\n")


def _legend_svg(y: float) -> str:
    items = [(COLORS[k], f"{k}: {NAMES[k]}", "legend") for k in COLORS] + [(IDLE, "idle", "legend")]
    out, x = [], LEFT
    for color, text, cls in items:
        out.append(f'<rect class="{cls}" x="{x}" y="{y}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{x + 16}" y="{y + 10}">{html.escape(text)}</text>')
        x += 24 + 6.2 * len(text)
    out.append(f'<text x="{x}" y="{y + 10}">(later chunks of a rank lighter)</text>')
    return "".join(out)


def _row_svg(tl: Timeline, r: int, y: float, x, scale: float, unit: str) -> list[str]:
    out = [f'<text x="{LEFT - 6}" y="{y + 13}" text-anchor="end">pp{r}</text>']
    for a, b in tl.gaps(r):
        out.append(f'<rect class="bubble" x="{x(a):.2f}" y="{y}" width="{x(b) - x(a):.2f}" height="{ROW}" '
                   f'fill="{IDLE}"><title>idle {(b - a) * scale:.4g} {unit}</title></rect>')
    for op in tl.ranks[r]:
        w = x(op.end) - x(op.start)
        tip = (f"{op.kind} micro-batch {op.mb}, stage {op.stage} (chunk {op.chunk}): {op.start * scale:.4g} - "
               f"{op.end * scale:.4g} {unit}")
        out.append(f'<rect class="op {op.kind}" x="{x(op.start):.2f}" y="{y}" width="{w:.2f}" height="{ROW}" '
                   f'fill="{shade(COLORS[op.kind], op.chunk, tl.vpp)}" stroke="#fff" stroke-width="0.5">'
                   f'<title>{html.escape(tip)}</title></rect>')
        if w >= 6 * len(str(op.mb)) + 3:
            out.append(f'<text class="mb" x="{x(op.start) + w / 2:.2f}" y="{y + 13}" text-anchor="middle">'
                       f'{op.mb}</text>')
    out.append(f'<text class="note" x="{WIDTH - RIGHT + 6}" y="{y + 13}">{html.escape(rank_note(tl, r))}</text>')
    return out


def _axis_svg(y: float, x, end: float, scale: float, unit: str) -> list[str]:
    out = [f'<line x1="{LEFT}" y1="{y}" x2="{x(end):.2f}" y2="{y}" stroke="#444"/>']
    for t in nice_ticks(end * scale):
        px = x(t / scale)
        out.append(f'<line x1="{px:.2f}" y1="{y}" x2="{px:.2f}" y2="{y + 4}" stroke="#444"/>'
                   f'<text x="{px:.2f}" y="{y + 16}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{x(end) + 8:.2f}" y="{y + 16}">{unit}</text>')
    return out
