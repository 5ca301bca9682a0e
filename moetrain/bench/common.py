"""What the `moetrain bench` subcommands share: the MoE layer shapes they run, the routings they take, and the
command-line checks that end in one line (a UserError: `error: ...` on stderr, exit 2).

    Shape, SHAPES, shape_at     the benchmark layers (T tokens, H hidden, I expert intermediate, E experts, K top-k),
                                optionally at another token count (--tokens)
    skew_alpha, ROUTINGS        the routing names: balanced, skewed (Dirichlet(0.3)), skewed:A (Dirichlet(A))
    parse_shapes, parse_routings, at_least, require_gpu
                                the checks, made before any GPU work so that a typo is reported on any machine

Imports nothing heavy: torch only inside require_gpu.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetrain.errors import UserError


@dataclass(frozen=True)
class Shape:
    name: str
    T: int
    H: int
    I: int  # the legend's name for the expert intermediate size
    E: int
    K: int


SHAPES = {
    "deepseek-v3": Shape("deepseek-v3", 8192, 7168, 2048, 256, 8),
    "deepseek-v3-ep8": Shape("deepseek-v3-ep8", 8192, 7168, 2048, 32, 8),  # 65536 rows over 32 local experts
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 16384, 2048, 768, 128, 8),
    "mixtral-8x7b": Shape("mixtral-8x7b", 16384, 4096, 14336, 8, 2),
    "gpt-oss-20b": Shape("gpt-oss-20b", 16384, 2880, 2880, 32, 4),
}

SKEW_ALPHA = 0.3  # "skewed": the Dirichlet concentration that #6's skew criterion is measured on
ROUTINGS = ("balanced (round-robin), skewed (per-expert shares drawn from Dirichlet(0.3)), skewed:A (from "
            "Dirichlet(A), A > 0: smaller is more uneven)")


def skew_alpha(routing: str) -> float | None:
    """None for balanced routing, else the Dirichlet concentration of a skewed one ("skewed": SKEW_ALPHA,
    "skewed:A": A); any other name is a UserError (a typo must not route as skewed without a word)."""
    if routing == "balanced":
        return None
    if routing == "skewed":
        return SKEW_ALPHA
    name, _, value = routing.partition(":")
    try:
        alpha = float(value) if name == "skewed" else float("nan")
    except ValueError:
        alpha = float("nan")
    if not 0 < alpha < float("inf"):
        raise UserError(f"unknown routing {routing!r}; valid: {ROUTINGS}")
    return alpha


def shape_at(name: str, tokens: int | None = None) -> Shape:
    """SHAPES[name], at ``tokens`` tokens per layer call instead of its own T when given (--tokens)."""
    return SHAPES[name] if tokens is None else replace(SHAPES[name], T=tokens)


def parse_shapes(text: str) -> list[str]:
    """--shapes: comma-separated SHAPES names, in the order given; an unknown name is a UserError."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in SHAPES:
            raise UserError(f"unknown shape {name!r}; valid: {', '.join(SHAPES)}")
    if not names:
        raise UserError(f"--shapes: no shape given; valid: {', '.join(SHAPES)}")
    return names


def parse_routings(text: str) -> list[str]:
    """--routing: comma-separated routing names (skew_alpha checks each)."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    for name in names:
        skew_alpha(name)
    if not names:
        raise UserError(f"--routing: no routing given; valid: {ROUTINGS}")
    return names


def at_least(option: str, value: int | None, low: int, what: str) -> None:
    """A UserError unless ``value`` (None: not given) is at least ``low``: "--tokens 0: at least 1 token per call"."""
    if value is not None and value < low:
        raise UserError(f"{option} {value}: at least {low} {what}")


def require_gpu(command: str) -> None:
    """A UserError naming the subcommand when no CUDA GPU is visible (`moetrain bench NAME needs a CUDA GPU`)."""
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"moetrain bench {command} needs a CUDA GPU (none is visible)")
