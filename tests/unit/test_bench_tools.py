"""The `moetrain bench` tools without a GPU: the shared argument checks, the host-time hooks of `bench host` / `bench
gaps`, their tables, and `bench kernels`' kernel rows (each against numbers worked out by hand)."""

import subprocess
import sys
import types

import pytest
import torch

from moetrain import cli
from moetrain.bench import common
from moetrain.config.load import load_config
from moetrain.errors import UserError

GPU_TOOLS = ("moe", "train", "rows", "host", "gaps", "kernels", "optim")


def test_every_registered_bench_names_a_module_with_main():
    import importlib

    assert set(cli.BENCHMARKS) == {*GPU_TOOLS, "gemm", "roofline", "jax"}  # jax: tests/jax/test_jax_bench.py
    for name, (module, _) in cli.BENCHMARKS.items():
        if name != "gemm":  # (its module imports the Triton kernels' tuning: covered by the kernel tests)
            assert callable(importlib.import_module(module).main), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("which", GPU_TOOLS[2:])
def test_gpu_tools_refuse_without_gpu_in_one_line(which):
    proc = subprocess.run([sys.executable, "-m", "moetrain", "bench", which], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: moetrain bench {which} needs a CUDA GPU (none is visible)"


@pytest.mark.parametrize("which, argv, match", [
    ("host", ["--shapes", "qwen3"], "unknown shape 'qwen3'"),
    ("host", ["--launches", "fast"], "--launches 'fast'"),
    ("host", ["--calls", "0"], "--calls 0: at least 1 call"),
    ("gaps", ["--routing", "balanced,skewed"], "one routing per run"),
    ("gaps", ["--routing", "uniform"], "unknown routing 'uniform'"),
    ("kernels", ["--reps", "0"], "--reps 0: at least 1 repetition"),
    ("kernels", ["--tokens", "5"], None),  # not an option of bench kernels: argparse's own exit
])
def test_bad_arguments_are_one_line_errors_before_the_gpu_check(which, argv, match):
    import importlib

    main = importlib.import_module(cli.BENCHMARKS[which][0]).main
    if match is None:
        with pytest.raises(SystemExit):
            main(argv)
        return
    with pytest.raises(UserError, match=match):
        main(argv)


def test_shapes_and_routings_are_checked_once_for_every_tool():
    assert common.parse_shapes("qwen3-30b-a3b, mixtral-8x7b") == ["qwen3-30b-a3b", "mixtral-8x7b"]
    assert common.shape_at("qwen3-30b-a3b", 4096).T == 4096 and common.shape_at("qwen3-30b-a3b").T == 16384
    assert common.parse_routings("balanced,skewed:1000") == ["balanced", "skewed:1000"]
    for text in ("", ","):
        with pytest.raises(UserError, match="no shape given"):
            common.parse_shapes(text)
    with pytest.raises(UserError, match="--tokens 0: at least 1 token"):
        common.at_least("--tokens", 0, 1, "token")
    common.at_least("--tokens", None, 1, "token")  # not given: nothing to check


def test_wrapping_reaches_every_module_that_imported_the_function_and_reports_the_missing():
    from moetrain.bench.host_hooks import wrap_functions

    def piece(x):
        return x + 1

    home = types.ModuleType("fake_home")
    home.piece = piece
    user = types.ModuleType("fake_user")
    user.piece = piece  # `from fake_home import piece`
    sys.modules.update(fake_home=home, fake_user=user)
    try:
        seen = []

        def wrap(name, fn):
            def wrapped(*args):
                seen.append(name)
                return fn(*args)
            return wrapped

        missing = wrap_functions(wrap, ("fake_home:piece", "fake_home:gone", "no_such_module:f"))
        assert missing == ["fake_home:gone", "no_such_module:f"]
        assert home.piece(1) == 2 and user.piece(2) == 3 and seen == ["piece", "piece"]
    finally:
        del sys.modules["fake_home"], sys.modules["fake_user"]


def test_every_wrapped_function_exists():
    # the layer's code moved on when one is missing: `bench host` would still run but not time it
    from moetrain.bench.host_hooks import WRAPPED, wrap_functions

    assert wrap_functions(lambda name, fn: fn) == [], WRAPPED


def test_host_timers_count_the_outermost_call_and_every_launch():
    from moetrain.bench.host_breakdown import Timers

    ticks = iter(range(100))
    timers = Timers(clock=lambda: next(ticks) * 1e-6)  # one microsecond per clock reading
    inner = timers.wrap("inner", lambda: None)

    def outer_body(depth):
        inner()
        if depth:
            outer(depth - 1)

    outer = timers.wrap("outer", outer_body)
    launch = timers.wrap("launch k", lambda: None)
    timers.phase = "forward"
    outer(1)  # outer (once, with its own nested call inside), inner twice
    timers.phase = "backward"
    launch()
    launch()
    assert dict(timers.calls) == {"forward: inner": 2, "forward: outer": 1, "backward: launch k": 2}
    # clock readings: outer 0, inner 1-2, (nested outer not timed), inner 3-4, outer ends at 5; launches 6-7, 8-9
    assert timers.total["forward: outer"] == pytest.approx(5e-6)
    assert timers.total["forward: inner"] == pytest.approx(2e-6)
    assert timers.total["backward: launch k"] == pytest.approx(2e-6)
    lines = timers.table(calls=2)
    assert lines[1].split() == ["forward:", "outer", "0.5", "2.5", "5.0"]
    assert lines[-1].split() == ["backward:", "launch", "k", "1.0", "1.0", "1.0"]


def test_idle_segments_are_the_eager_minus_the_host_ahead_gpu_time():
    from moetrain.bench.eager_gaps import idle_segments

    # (label, host ms, GPU ms) per marker; eager waits 0.3 ms of GPU time between "route" and "fc1"
    eager = [[("route", 0.0, 0.1), ("fc1", 0.5, 0.6), ("end", 2.0, 2.6)],
             [("route", 0.0, 0.1), ("fc1", 0.4, 0.8), ("end", 2.2, 2.8)]]
    ahead = [[("route", 0.0, 0.1), ("fc1", 0.5, 0.3), ("end", 2.0, 2.3)]]
    rows = idle_segments(eager, ahead)
    assert [(i, label) for i, label, *_ in rows] == [(0, "route"), (1, "fc1")]
    (_, _, host, gpu, seg_e, seg_a, idle), (*_, idle_fc1) = rows
    assert (host, gpu, seg_e, seg_a) == pytest.approx((0.0, 0.1, 0.6, 0.2))
    assert idle == pytest.approx(0.4) and idle_fc1 == pytest.approx(0.0)


def test_kernel_rows_put_the_largest_eager_graph_difference_first():
    from moetrain.bench.kernel_table import kernel_rows

    totals = {"eager": {"gemm": (6.0, 3000.0), "sort": (1.0, 90.0)},
              "graph": {"gemm": (6.0, 2900.0), "sort": (1.0, 50.0), "graph-only": (1.0, 200.0)}}
    rows = kernel_rows(totals)
    assert [r[0] for r in rows] == ["graph-only", "gemm", "sort"]
    assert rows[0] == ("graph-only", 0.0, 0.2, 1.0) and rows[1][1:] == pytest.approx((3.0, 2.9, 6.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals without a GPU")
def test_fp8_gemm_bench_checks_its_arguments_then_refuses_without_gpu():
    def run(*argv):
        proc = subprocess.run([sys.executable, "-m", "moetrain", "bench", "gemm", *argv], capture_output=True,
                              text=True, timeout=120, check=False)
        return proc.returncode, proc.stderr.strip()

    assert run("--precision", "fp4") == (2, "error: --precision 'fp4': valid: bf16, fp8")
    assert run("--precision=fp8", "--shapes", "nope")[1].startswith("error: unknown shape 'nope'")
    assert run("--precision", "fp8") == (2, "error: moetrain bench gemm --precision fp8 needs a CUDA GPU (none is "
                                            "visible)")


def test_bench_train_names_a_bad_fp8_dense_recipe_before_any_gpu_check():
    from moetrain.bench.train_step import main

    with pytest.raises(UserError, match="--fp8-dense rowise: not a precision.fp8_dense recipe"):
        main(["--fp8-dense", "rowise"])


def test_bench_train_refuses_a_peer_it_cannot_build_before_any_gpu_check():
    from moetrain.bench.train_step import main

    with pytest.raises(UserError, match="the transformers peer: .*MoE models only.*; pass --no-peer"):
        main(["--preset", "tiny", "--set", "moe.num_experts=0"])


@pytest.mark.parametrize("preset, over, family", [
    ("qwen3-30b-a3b", [], "Qwen3MoeForCausalLM"), ("mixtral-8x7b", [], "MixtralForCausalLM"),
    ("deepseek-v3", ["moe.num_experts=32", "moe.first_k_dense=1", "model.mtp_num_layers=1"], "DeepseekV3ForCausalLM"),
    ("gpt-oss-20b", [], "GptOssForCausalLM")])
def test_bench_train_peer_is_the_same_model(preset, over, family):
    """The peer's transformers model has exactly moetrain's parameters (the export mapping; MTP dropped), at a
    reduced width so that both build quickly on the CPU."""
    transformers = pytest.importorskip("transformers")
    from moetrain.bench.train_step import hf_config
    from moetrain.models.transformer import MoETransformer

    narrow = ["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256", "model.vocab_size=1000",
              "moe.moe_ffn_hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
              "model.q_lora_rank=64", "model.kv_lora_rank=32"]
    cfg = load_config(preset=preset, overrides=narrow + over)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(cfg))
    assert type(hf).__name__ == family
    cfg = load_config(preset=preset, overrides=narrow + over + ["model.mtp_num_layers=0"])
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in MoETransformer(cfg).parameters())


def test_bench_train_proxy_fixes_the_shape():
    from moetrain.bench.train_step import main

    with pytest.raises(UserError, match="--proxy qwen3-4l fixes the model and batch; drop --layers"):
        main(["--proxy", "qwen3-4l", "--layers", "2"])


@pytest.mark.parametrize("name, label", [
    ("_rowgroup_pingpong_kernel", "expert GEMMs"), ("_wgrad_kernel", "expert GEMMs"),
    ("void at::native::grouped_mm_kernel<bf16>", "expert GEMMs"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", "dense GEMMs"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention"),
    ("_fused_kernel", "loss"), ("_adamw_kernel", "optimizer + grad norm"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamW>", "optimizer + grad norm"),
    ("_place_rows_kernel", "routing, gathers, scatters"), ("_rope_fwd_kernel", "norms, RoPE, activations"),
    ("void at::native::vectorized_layer_norm_kernel<float>", "norms, RoPE, activations"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", "other (elementwise, copies, reductions)"),
])
def test_profile_kernels_fall_in_the_steps_parts(name, label):
    from moetrain.bench.kernel_classes import kernel_class

    assert kernel_class(name) == label


def test_top_kernels_sums_each_class_per_step(tmp_path):
    import json

    from moetrain.bench.train_step import top_kernels

    events = [{"cat": "kernel", "name": "_adamw_kernel", "dur": 3000.0},
              {"cat": "kernel", "name": "nvjet_tst_a", "dur": 4000.0},
              {"cat": "kernel", "name": "nvjet_tst_b", "dur": 2000.0},
              {"cat": "cpu_op", "name": "aten::mm", "dur": 9e9}]  # not a kernel: left out
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    text = top_kernels(trace, steps=2)
    assert "GPU busy 4.5 ms/step" in text
    assert "    3.00   66.7%  dense GEMMs" in text and "    1.50   33.3%  optimizer + grad norm" in text
