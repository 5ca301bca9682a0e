"""The multi-tensor AdamW and sum-of-squares kernels (``kernels.adamw``) against their references: the optimizer's
explicit path (``train.optim.adamw_reference``) for every dtype combination, torch._fused_adamw_ where the dtypes
agree, torch._foreach_norm for the norm. Tensors of odd sizes (1, a block and one more, more than a chunk, not a
multiple of the block) in one launch, decay on and off in the same launch, steps 1 and 5, grad_scale and found_inf.
On the CPU the kernels run in Triton's interpreter, with chunks of 128 elements (blocks of 32 or 64).

Bounds: fp32 outputs within 1e-6 relative of the reference (elementwise, plus an absolute 1e-6 of the tensor's
largest value for elements that cancel); bf16 outputs within one bf16 ulp of the reference's, plus the same
absolute term (the reference orders its fp32 operations differently, e.g. lerp for the first moment, and the GPU
contracts multiply-adds, so a value near a rounding boundary may round the other way, and where the exact result
is ~0, e.g. a bf16 gradient of exactly -9 x a bf16 first moment at beta1 = 0.9, both are fp32 residues of
different sizes); the bf16 parameter copy of an fp32 master equals that master's rounding (round to nearest even)
exactly."""

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels.adamw import Tile, TensorTable, adamw_update, grad_sq_norms  # noqa: E402
from moetrain.train.optim import adamw_reference  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TILE = Tile() if ON_GPU else Tile(warps=1, per_thread=1, chunk=128)  # CPU: blocks of 32, 4 a chunk
SIZES = [1, 65, 300, 7, 128] if not ON_GPU else [1, 2049, 40000, 7, 16384, 100003]
DECAY = [1, 0, 1, 0, 1] if not ON_GPU else [1, 0, 1, 0, 1, 1]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
B1, B2, EPS, WD, LR = 0.9, 0.95, 1e-4, 0.1, 1e-2  # eps comparable to sqrt(v): where it is added shows

# (target, copy or None, grad, exp_avg, exp_avg_sq): every combination PrecisionAwareAdamW makes from fp32 / bf16
# (an fp32 master with its bf16 parameter, a bf16 parameter in place, an fp32 parameter), and fp16's two forms
COMBOS = [(t, c, g, m, v) for t, c in ((F32, BF16), (BF16, None), (F32, None))
          for g in (F32, BF16) for m in (F32, BF16) for v in (F32, BF16)]
COMBOS += [(F32, F16, F32, F32, F32), (F16, None, F16, F16, F16)]


def _name(combo):
    short = {F32: "fp32", BF16: "bf16", F16: "fp16", None: "-"}
    return "t{}c{}g{}m{}v{}".format(*(short[d] for d in combo))


def _state(combo, seed):
    """Per tensor [target, copy, grad, exp_avg, exp_avg_sq] on DEVICE; the copy NaN-poisoned."""
    target, copy, grad, m, v = combo
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in SIZES:
        rows.append([
            torch.randn(n, generator=gen).to(target),
            torch.full((n,), float("nan"), dtype=copy) if copy is not None else None,
            (torch.randn(n, generator=gen) * 0.3).to(grad),
            (torch.randn(n, generator=gen) * 0.05).to(m),
            (torch.rand(n, generator=gen) * 0.01 + 1e-8).to(v),
        ])
    for row in rows[1:]:  # the first moment's exact update is 0 here (module doc): both sides leave fp32 residues
        row[3][:4] = torch.tensor([0.0625, -0.125, 0.03125, -0.046875]).to(m)  # rows of 7+: the bound's scale,
        row[2][:4] = (-9 * row[3][:4].float()).to(grad)  # the largest value, is another element
    return [[t.to(DEVICE) if t is not None else None for t in row] for row in rows]


def _run_kernel(rows, step, grad_scale=None, found_inf=None, lr=LR):
    cols = [[r[i] for r in rows] for i in (0, 2, 3, 4)]
    cols.append([r[1] for r in rows] if rows[0][1] is not None else None)
    table = TensorTable.build(cols, DECAY, TILE.chunk)
    scalar = lambda x: torch.tensor(float(x), device=DEVICE)  # noqa: E731
    adamw_update(table, scalar(step), scalar(lr), B1, B2, EPS, WD, grad_scale=None if grad_scale is None
                 else scalar(grad_scale), found_inf=None if found_inf is None else scalar(found_inf), tile=TILE)


def _run_reference(rows, step, grad_scale=1.0):
    for row, decay in zip(rows, DECAY):
        target, _, grad, m, v = row
        adamw_reference(target, grad, m, v, LR, step, B1, B2, EPS, WD if decay else 0.0, grad_scale=grad_scale)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each value of x (8 significant bits; the smallest normal's at zero)."""
    _, exponent = torch.frexp(x.float().abs().clamp_min(2.0 ** -126))
    return torch.ldexp(torch.ones_like(x, dtype=F32), exponent - 8)


def _check(got: torch.Tensor, want: torch.Tensor, what: str, ulps: int = 1, atol: float = 0.0) -> int:
    """The module doc's bound for got's dtype (``ulps`` bf16 ulps for 16-bit, an extra ``atol`` for fp32); returns the
    number of elements that differ."""
    assert got.dtype == want.dtype and not torch.isnan(got).any(), what
    got, want = got.cpu(), want.cpu()
    diff = (got.float() - want.float()).abs()
    cancel = 1e-6 * want.abs().max().float() + atol
    if got.dtype == F32:
        bound = 1e-6 * want.abs() + cancel
    else:  # 16-bit: one ulp of the reference (bf16's ulp bounds fp16's for these magnitudes)
        bound = ulps * _bf16_ulp(want) + cancel
    assert torch.all(diff <= bound), (what, (diff / bound).max().item())
    return int((diff > 0).sum())


def _clone(rows):
    return [[t.clone() if t is not None else None for t in row] for row in rows]


@pytest.mark.parametrize("step", [1, 5])
@pytest.mark.parametrize("combo", COMBOS, ids=_name)
def test_update_matches_the_explicit_reference(combo, step):
    rows = _state(combo, seed=step)
    want = _clone(rows)
    _run_kernel(rows, step)
    _run_reference(want, step)
    moved = 0
    for i, (got_row, want_row) in enumerate(zip(rows, want)):
        target, copy, _, m, v = got_row
        for name, j in (("target", 0), ("exp_avg", 3), ("exp_avg_sq", 4)):
            _check(got_row[j], want_row[j], f"{name} of tensor {i}")
        if copy is not None:  # the parameter is the master's rounding, written in the same pass
            assert torch.equal(copy, target.to(copy.dtype)), i
        moved += int(not torch.equal(target.cpu(), _state(combo, seed=step)[i][0].cpu()))
    assert moved == len(SIZES)  # every tensor was updated (agreement is not vacuous)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_update_matches_torch_fused_adamw_with_grad_scale(dtype):
    """Where every dtype agrees torch's kernel is a second reference: one call per weight decay (it takes one)."""
    rows = _state((dtype, None, dtype, dtype, dtype), seed=3)
    want = _clone(rows)
    _run_kernel(rows, 5, grad_scale=2.5, found_inf=0.0)
    for decay in (0, 1):
        sel = [r for r, d in zip(want, DECAY) if d == decay]
        step = torch.tensor(5.0, device=DEVICE)
        torch._fused_adamw_([r[0] for r in sel], [r[2] for r in sel], [r[3] for r in sel], [r[4] for r in sel], [],
                            [step] * len(sel), lr=LR, beta1=B1, beta2=B2, weight_decay=WD if decay else 0.0, eps=EPS,
                            amsgrad=False, maximize=False, grad_scale=torch.tensor(2.5, device=DEVICE),
                            found_inf=torch.tensor(0.0, device=DEVICE))
    for i, (got_row, want_row) in enumerate(zip(rows, want)):
        for name, j in (("target", 0), ("exp_avg", 3), ("exp_avg_sq", 4)):
            _check(got_row[j], want_row[j], f"{name} of tensor {i}")


def test_grad_scale_divides_the_gradients():
    combo = (F32, BF16, BF16, BF16, F32)
    rows = _state(combo, seed=4)
    want = _clone(rows)
    _run_kernel(rows, 2, grad_scale=3.0, lr=torch.tensor(LR, device=DEVICE))
    _run_reference(want, 2, grad_scale=3.0)
    for got_row, want_row in zip(rows, want):
        for j in (0, 3, 4):
            _check(got_row[j], want_row[j], str(j))


def test_found_inf_moves_nothing():
    rows = _state((F32, BF16, F32, BF16, BF16), seed=5)
    before = _clone(rows)
    _run_kernel(rows, 3, grad_scale=2.0, found_inf=1.0)
    for got_row, old_row in zip(rows, before):
        for got, old in zip(got_row, old_row):
            assert torch.equal(got.view(torch.uint8), old.view(torch.uint8))  # the poisoned copy too: nothing written


def test_sq_norms_match_foreach_norm():
    gen = torch.Generator().manual_seed(6)
    for dtype in (F32, BF16, F16):
        grads = [(torch.randn(n, generator=gen) * 3).to(dtype).to(DEVICE) for n in SIZES + [0, 1]]
        table = TensorTable.build([grads], chunk=TILE.chunk)
        sq = grad_sq_norms(table, tile=TILE)
        want = torch.stack(torch._foreach_norm([g.float() for g in grads if g.numel()], 2.0)) ** 2
        assert table.n == len(SIZES) + 1 and table.aligned  # the empty gradient is left out
        torch.testing.assert_close(sq.cpu(), want.cpu(), rtol=1e-6, atol=0)
    shifted = [torch.randn(n + 1, generator=gen).to(DEVICE)[1:] for n in SIZES]  # 4 bytes past an aligned start
    table = TensorTable.build([shifted], chunk=TILE.chunk)
    want = torch.stack(torch._foreach_norm(shifted, 2.0)) ** 2
    assert not table.aligned
    torch.testing.assert_close(grad_sq_norms(table, tile=TILE).cpu(), want.cpu(), rtol=1e-6, atol=0)


def test_table_refuses_what_the_kernel_cannot_read():
    a, b = torch.zeros(4, 6, device=DEVICE), torch.zeros(6, 4, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        TensorTable.build([[a.t()]])
    with pytest.raises(ValueError, match="of 24 elements"):
        TensorTable.build([[a], [torch.zeros(5, device=DEVICE)]])
    with pytest.raises(ValueError, match="one dtype"):
        TensorTable.build([[a, b.double()]])
    table = TensorTable.build([[a]], chunk=256)
    with pytest.raises(ValueError, match="built for chunks of 256"):
        grad_sq_norms(table, tile=Tile(chunk=512))


@pytest.mark.parametrize("step", [1, 2, 1000, 123457])
def test_bias_corrections_keep_their_digits(step):
    """From w = 0 the update alone is compared, so an error in 1 - beta2 ** step shows: at beta2 = 0.999 and step 1
    it is 1e-3, which fp32 arithmetic (or an fp32 beta) gets wrong in the 5th digit; the power's 32 bits of step."""
    gen = torch.Generator().manual_seed(step)
    n, b1, b2 = 300, 0.9, 0.999
    g = (torch.randn(n, generator=gen) * 0.3).to(DEVICE)
    got = [torch.zeros(n, device=DEVICE), g, torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)]
    want = [t.clone() for t in got]
    table = TensorTable.build([[t] for t in got] + [None], [0], TILE.chunk)
    scalar = lambda x: torch.tensor(float(x), device=DEVICE)  # noqa: E731
    adamw_update(table, scalar(step), scalar(LR), b1, b2, 1e-12, 0.0, tile=TILE)
    adamw_reference(*want, LR, step, b1, b2, 1e-12, 0.0)
    for j in (0, 2, 3):
        torch.testing.assert_close(got[j].cpu(), want[j].cpu(), rtol=1e-6, atol=0)
