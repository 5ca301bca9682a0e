"""The `moetrain` command line: a thin argparse layer over library functions.

Each command loads what it needs lazily inside its function, so `config show` and
`model info` never import torch. User errors (``moetrain.errors.UserError``, missing
files) print one line ``error: <message>`` on stderr and exit 2; Ctrl-C exits 130.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from moetrain import __version__
from moetrain.errors import UserError, os_reason

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


# ---- commands -----------------------------------------------------------------------------

def _load(args: argparse.Namespace):
    from moetrain.config.load import load_config

    return load_config(path=args.config, preset=args.preset, overrides=args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from moetrain.train.trainer import run  # imports torch: only here

    run(cfg)
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from moetrain.config.load import config_docs, dump_config

    if args.doc:
        sys.stdout.write(config_docs())
    else:
        sys.stdout.write(dump_config(_load(args)))
    return 0


def cmd_model_info(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from moetrain.model_info import model_info_report

    print(model_info_report(cfg, as_json=args.json))
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from moetrain.train.tokenize import prepare

    info = prepare(args.input, args.tokenizer, args.output)
    print(f"wrote {info.get('num_tokens')} tokens in {info.get('num_docs')} documents to "
          f"{info.get('output', args.output)} ({info.get('seconds')} s)")
    return 0


BENCHMARKS = {  # name: (module with main(argv), what it measures); bench/README.md says which page reports each
    "moe": ("moetrain.bench.moe_layer", "MoE layer forward+backward against torchtitan-style references"),
    "train": ("moetrain.bench.train_step", "training step against Hugging Face transformers"),
    "gemm": ("moetrain.kernels.sweep_grouped_gemm", "grouped GEMM kernels against torch._grouped_mm"),
    "rows": ("moetrain.bench.row_kernels", "the row kernels' programs swept against the PyTorch ops and a copy"),
    "host": ("moetrain.bench.host_breakdown", "host time of each piece of an eager MoE layer call"),
    "gaps": ("moetrain.bench.eager_gaps", "where an eager MoE layer call's GPU waits on the host"),
    "kernels": ("moetrain.bench.kernel_table", "the MoE layer's kernels eager against replayed from a CUDA graph"),
    "roofline": ("moetrain.bench.roofline", "skewed routing's cost of the six expert GEMMs by roofline (CPU)"),
    "optim": ("moetrain.bench.optim", "grad norm + AdamW update against their HBM floor, per dtype set and path"),
    "jax": ("moetrain.bench.jax_gemm", "the JAX grouped GEMM (FC1 -> SwiGLU -> FC2 fwd+bwd) against jax.lax.ragged_dot, "
                                       "tokamax and torch._grouped_mm"),
}


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.which][0])
    return module.main(args.bench_args) or 0  # a benchmark may exit 1 (the row sweep when a candidate disagrees)


# ---- parser -------------------------------------------------------------------------------

def _add_config_source(p: argparse.ArgumentParser, required: bool = False) -> None:
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("--config", metavar="FILE", help="YAML config file (may use `extends:`)")
    group.add_argument("--preset", metavar="NAME", help="built-in preset, e.g. tiny, deepseek-v3")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, values parsed as YAML: moe.topk=2 train.recompute_layer_ids=[0,1]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moetrain", description="Train Mixture-of-Experts language models on PyTorch.")
    parser.add_argument("--version", action="version", version=f"moetrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser("train", help="train a model (default: the tiny preset on synthetic data)")
    _add_config_source(p)
    p.set_defaults(func=cmd_train)

    config = commands.add_parser("config", help="inspect configurations").add_subparsers(
        dest="subcommand", metavar="SUBCOMMAND", required=True)
    p = config.add_parser("show", help="print the resolved config as YAML")
    _add_config_source(p)
    p.add_argument("--doc", action="store_true", help="list every key with its type, default and meaning")
    p.set_defaults(func=cmd_config_show)

    model = commands.add_parser("model", help="inspect model architectures").add_subparsers(
        dest="subcommand", metavar="SUBCOMMAND", required=True)
    p = model.add_parser("info", help="parameters, active parameters and FLOPs per token")
    _add_config_source(p, required=True)
    p.add_argument("--json", action="store_true", help="machine-readable JSON")
    p.set_defaults(func=cmd_model_info)

    data = commands.add_parser("data", help="prepare datasets").add_subparsers(
        dest="subcommand", metavar="SUBCOMMAND", required=True)
    p = data.add_parser("prepare", help="tokenize text files into a training dataset directory")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files to tokenize (.jsonl/.ndjson: one {\"text\": ...} object per line; any other "
                   "file: UTF-8 text, documents separated by blank lines) or directories (every file "
                   "under them, recursively, sorted; names starting with '.' skipped)")
    p.add_argument("--tokenizer", required=True, metavar="TOKENIZER",
                   help="a Hugging Face tokenizer.json, or `bytes` for a byte-level tokenizer")
    p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to write (train with data.source=tokens data.path=DIR; "
                   "the eval split is data.eval_fraction, applied when the dataset is loaded)")
    p.set_defaults(func=cmd_data_prepare)

    from moetrain.convert import register as register_convert  # neither imports torch
    from moetrain.plan.cli import register as register_plan

    register_plan(commands, _add_config_source)
    register_convert(commands, _add_config_source)

    p = commands.add_parser("bench", help="side-by-side benchmarks against peers (one process, GPU but roofline)")
    p.add_argument("which", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHMARKS.items()))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark (see its --help)")
    p.set_defaults(func=cmd_bench)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    # parse_known_args so that overrides may also follow options (`train --config f x.y=1`);
    # anything left over that is not key=value is still an error.
    args, extra = parser.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")
    overrides = [a for a in extra if takes_overrides and "=" in a and not a.startswith("-")]
    rest = [a for a in extra if a not in overrides]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if overrides:
        args.overrides = list(args.overrides) + overrides
    return args


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)  # usage errors: argparse prints usage and exits 2
    try:
        return args.func(args)
    except KeyboardInterrupt as err:
        # The trainer's interrupts say what was and was not saved.
        detail = f": {_one_line(str(err))}" if str(err) else ""
        print(f"error: interrupted{detail}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UserError as err:
        _print_error(f"error: {_one_line(str(err))}")
        return EXIT_USER_ERROR
    except BrokenPipeError:
        # `moetrain config show | head`: the reader went away; not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as err:
        # A file-system failure not caught closer to its cause (disk full, read-only, permission):
        # one line naming the path; an OSError without a path is a bug and keeps its traceback.
        if err.filename is None:
            raise
        _print_error(f"error: {os_reason(err)}: {err.filename}")
        return EXIT_USER_ERROR
    except Exception as err:
        return _distributed_failure(err)


def _print_error(line: str) -> None:
    """One error line; in a distributed run only the first failing rank prints, prefixed with its rank."""
    if "torch.distributed" in sys.modules:
        from moetrain.distributed import faults

        if not faults.claim_first_error():
            return
        line = line.replace("error: ", f"error: {faults.rank_prefix()}", 1)
    print(line, file=sys.stderr)


def _distributed_failure(err: Exception) -> int:
    """An unexpected error on one rank of a distributed run: its traceback once (the first failing rank's; a
    collective failing because another rank did says so in one line); outside a run, the error propagates."""
    from moetrain.distributed import faults

    if "torch.distributed" not in sys.modules or not faults.rank_prefix():
        raise err
    if not faults.claim_first_error():
        return 1
    reason = faults.lost_peer(err)
    if reason is not None:
        print(f"error: {faults.rank_prefix()}{reason}", file=sys.stderr)
        return 1
    import traceback

    print(f"error: {faults.rank_prefix()}{type(err).__name__}: {_one_line(str(err))}", file=sys.stderr)
    traceback.print_exception(err, file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
