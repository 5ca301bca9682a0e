"""Expert-parallel dispatchers on 2 gloo ranks, fp64: the all-to-all and the sync-free dispatcher give the EP=1
layer's output and gradients (x, routing weights, expert weights) exactly as each other and, up to summation order,
as one rank holding every expert; the sync-free one reads no scalar on the host in forward or backward; a capacity
drops rows and counts them."""

import pytest
import torch
from gloo_ranks import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.models.moe.dispatch import Dispatcher

T, H, I, E, K = 12, 8, 6, 4, 2
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}


class RowExperts(torch.nn.Module):
    """Experts computed row by row (each row gathers its expert's weights): sync-free on the CPU, unlike the CPU
    grouped GEMM, whose group loop reads the group ends."""

    backend, b2 = "torch", None

    def __init__(self, w1, w2):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(w1), torch.nn.Parameter(w2)

    @property
    def num_experts(self):
        return self.w1.shape[0]

    def compute_rows(self, rows, offs, probs):
        from moetrain.ops.dispatch import expert_of_rows

        e = expert_of_rows(offs, rows.shape[0])
        h = torch.bmm(self.w1[e], rows.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up * probs.unsqueeze(-1)
        return torch.bmm(self.w2[e], a.unsqueeze(-1)).squeeze(-1)


class FailOnHostRead(TorchDispatchMode):
    """Raises on any read of tensor data by the host: the aten ops that return a host value, and tolist / numpy,
    which read a CPU tensor's memory without dispatching (a CUDA tensor's would synchronise)."""

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name in self._saved:
            setattr(torch.Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in HOST_READS:
            raise AssertionError(f"host read: {func}")
        return func(*args, **(kwargs or {}))


def _refuse(name):
    def read(*args, **kwargs):
        raise AssertionError(f"host read: Tensor.{name}")
    return read


def _inputs(rank):
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens and routing
    x = torch.randn(T, H, dtype=torch.float64, generator=g)
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weight = torch.rand(T, K, dtype=torch.float64, generator=g)
    return x, topk_idx, weight


def _weights():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * I, H, dtype=torch.float64, generator=g) * 0.3,
            torch.randn(E, H, I, dtype=torch.float64, generator=g) * 0.3)


def _run(dispatcher, experts, rank, mode=None):
    x, idx, w = _inputs(rank)
    x.requires_grad_()
    w.requires_grad_()
    dy = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + rank))
    if mode is not None:
        with mode:
            y = dispatcher(x, idx, w, experts)
            y.backward(dy)
    else:
        y = dispatcher(x, idx, w, experts)
        y.backward(dy)
    return y.detach(), x.grad, w.grad, experts.w1.grad, experts.w2.grad


def _ranks(rank, world_size):
    import torch.distributed as dist

    from moetrain.distributed.expert_parallel import AllToAllDispatcher
    from moetrain.distributed.sync_free import SyncFreeDispatcher

    group, El = dist.group.WORLD, E // world_size
    w1, w2 = _weights()
    mine = slice(rank * El, (rank + 1) * El)
    results = {}
    for name, disp in (("alltoall", AllToAllDispatcher(group, world_size, E)),
                       ("sync_free", SyncFreeDispatcher(group, world_size, E))):
        experts = RowExperts(w1[mine].clone(), w2[mine].clone())
        results[name] = _run(disp, experts, rank, FailOnHostRead() if name == "sync_free" else None)
    for a, b in zip(results["alltoall"], results["sync_free"]):
        assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="host read"):  # the mode sees the splits-based one's read
        _run(AllToAllDispatcher(group, world_size, E), RowExperts(w1[mine].clone(), w2[mine].clone()), rank,
             FailOnHostRead())

    # one rank holding every expert, on the concatenation of both ranks' tokens: the same output and gradients
    full = RowExperts(w1.clone(), w2.clone())
    outs = [_run(Dispatcher(), full, r) for r in range(world_size)]
    y, dx, dw = results["alltoall"][:3]
    torch.testing.assert_close(y, outs[rank][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, outs[rank][1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, outs[rank][2], rtol=1e-12, atol=1e-12)
    # the expert weights' gradient sums both ranks' tokens (full.w1.grad accumulated over both runs)
    torch.testing.assert_close(results["alltoall"][3], full.w1.grad[mine], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results["alltoall"][4], full.w2.grad[mine], rtol=1e-12, atol=1e-12)


def test_dispatchers_match_each_other_and_one_rank():
    run_ranks(_ranks, world_size=2)


def _capacity_ranks(rank, world_size):
    import torch.distributed as dist

    from moetrain.distributed.sync_free import SyncFreeDispatcher

    w1, w2 = _weights()
    El = E // world_size
    mine = slice(rank * El, (rank + 1) * El)
    x, _, w = _inputs(rank)
    idx = torch.tensor([[0, 1]] * T)  # every row to rank 0's experts: capacity 1.0 keeps T*K/2 of rank's T*K
    disp = SyncFreeDispatcher(dist.group.WORLD, world_size, E, capacity_factor=1.0)
    y = disp(x, idx, w, RowExperts(w1[mine].clone(), w2[mine].clone()))
    assert int(disp.dropped_rows) == T * K - T * K // world_size
    # capacity C = T*K/2 rows per peer; rows go sorted by expert, so expert 0's T rows are kept and expert 1's dropped
    kept_only = torch.tensor([[0, -1]] * T)
    want = Dispatcher()(x, kept_only, w, RowExperts(w1.clone(), w2.clone()))
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", [2])
def test_sync_free_capacity_drops_and_counts(world_size):
    run_ranks(_capacity_ranks, world_size=world_size)
