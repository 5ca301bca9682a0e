"""kernels/launch.py on the CPU: what a launch's key tells apart (the specializations Triton compiles separately),
and that the interpreter takes Triton's own path."""

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from moetrain.kernels import launch as L  # noqa: E402


def test_tensors_differ_by_dtype_and_16_byte_alignment():
    base = torch.zeros(64)
    assert L._arg_spec(base) == L._arg_spec(torch.zeros(8))
    assert L._arg_spec(base[4:]) == L._arg_spec(base)  # 16 bytes in: still aligned
    assert L._arg_spec(base[1:]) != L._arg_spec(base)  # 4 bytes in
    assert L._arg_spec(base.to(torch.bfloat16)) != L._arg_spec(base)
    assert L._arg_spec(base)[1] is False  # the device kind: a CPU tensor never shares a CUDA one's key


@pytest.mark.parametrize("a, b, same", [(32, 48, True), (32, 33, False), (1, 2, False), (17, 33, True),
                                        (2**31 - 16, 2**31, False), (0, 16, False)])
def test_integers_differ_by_one_divisibility_and_width(a, b, same):
    assert (L._arg_spec(a) == L._arg_spec(b)) is same


def test_flags_and_floats():
    assert L._arg_spec(True) != L._arg_spec(False)
    assert L._arg_spec(True) != L._arg_spec(1)  # a bool is not the integer 1
    assert L._arg_spec(0.5) == L._arg_spec(2.0)
    assert L._arg_spec(None) != L._arg_spec(0.5)


def test_descriptors_differ_by_block_and_alignments():
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    d = TensorDescriptor(x, list(x.shape), list(x.stride()), [16, 32])
    assert L._arg_spec(d) == L._arg_spec(TensorDescriptor(x, [64, 64], [64, 1], [16, 32]))
    assert L._arg_spec(d) != L._arg_spec(TensorDescriptor(x, [64, 64], [64, 1], [32, 32]))
    assert L._arg_spec(d) != L._arg_spec(TensorDescriptor(x, [63, 64], [64, 1], [16, 32]))


def test_other_arguments_are_refused():
    with pytest.raises(TypeError, match="unexpected kernel argument of type str"):
        L._arg_spec("rows")


def test_keys_hold_the_keywords_and_device():
    args = (torch.zeros(4), 8)
    k = L.kernel_key("kernel", 0, args, {"BLOCK": 64, "num_warps": 4})
    assert k != L.kernel_key("kernel", 0, args, {"BLOCK": 128, "num_warps": 4})
    assert k != L.kernel_key("kernel", 1, args, {"BLOCK": 64, "num_warps": 4})
    assert k == L.kernel_key("kernel", 0, (torch.ones(4), 24), {"BLOCK": 64, "num_warps": 4})


def test_a_launch_hook_is_seen_only_when_one_is_set():
    import triton

    chain = triton.knobs.runtime.launch_enter_hook  # Triton 3.6: a chain of hooks, empty unless a profiler adds one
    assert not L._hooked(chain, triton.knobs.runtime.launch_exit_hook)
    assert not L._hooked(None)
    assert L._hooked(print)
    if hasattr(chain, "add"):
        chain.add(print)
        try:
            assert L._hooked(chain)
        finally:
            chain.remove(print)


def test_every_kernel_launch_of_the_package_goes_through_launch():
    # a `kernel[grid](...)` left in the package would take Triton's slower path on every call (~25% of the launches'
    # host time: bench/host_overhead.md); aot_compile's and the references' code launch nothing
    import ast
    from pathlib import Path

    import moetrain

    stray = []
    for path in Path(moetrain.__file__).parent.rglob("*.py"):
        if path.name == "launch.py" and path.parent.name == "kernels":  # the launcher itself
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                stray.append(f"{path.name}:{node.lineno}")
    assert not stray, f"launch these through moetrain.kernels.launch.launch: {stray}"
