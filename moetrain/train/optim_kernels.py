"""PrecisionAwareAdamW's Triton path (``moetrain.kernels.adamw``): the slots grouped by dtype combination, one
tensor table per group kept across steps, the update and the gradients' sums of squares launched over them.

Tables: a table holds tensor addresses, so it is rebuilt (and copied to the device, without a host sync) when one
changes: a ``param.grad`` that autograd allocated afresh. Under a CUDA graph capture nothing may be copied in: the
tables must exist before it (``PrecisionAwareAdamW.prepare_device_step``), and each table a capture reads is kept
for the life of the optimizer (a replay reads it again).

Imported only where the Triton path runs; triton itself only when a table is first built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def kernels():
    """moetrain.kernels.adamw, or a RuntimeError naming the missing package."""
    try:
        from moetrain.kernels import adamw
    except ImportError as err:
        raise RuntimeError(f"PrecisionAwareAdamW's multi-tensor AdamW kernel needs triton ({err}); install triton or "
                           "build the optimizer with kernel=False") from err
    return adamw


@dataclass(frozen=True)
class Hyper:
    """AdamW's constants, as the kernel takes them (betas compiled in)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float


class KernelPath:
    """Tables by group key, reused while their tensors' addresses stay (module doc); ``tile`` None: the kernel
    module's default."""

    def __init__(self, tile=None):
        self.tile = tile
        self._tables: dict = {}  # key -> (addresses, TensorTable)
        self._kept: list = []  # tables a captured graph reads

    def _tile(self):
        return self.tile if self.tile is not None else kernels().DEFAULT_TILE

    def table(self, key: tuple, columns: list, flags: list[int] | None = None):
        """The TensorTable of ``columns`` (see kernels.adamw.TensorTable.build), built anew only where an address,
        a flag or the tile's chunk changed."""
        chunk = self._tile().chunk
        addresses = (chunk, tuple(flags or ()), tuple(t.numel() for t in columns[0]),
                     tuple(tuple(t.data_ptr() for t in col) if col is not None else None for col in columns))
        cached = self._tables.get(key)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if cached is not None and cached[0] == addresses:
            table = cached[1]
        elif capturing:
            raise RuntimeError("PrecisionAwareAdamW: a tensor the kernel reads moved since its table was built, "
                               "inside a CUDA graph capture (nothing may be copied in there): call "
                               "prepare_device_step() right before capturing")
        else:
            table = kernels().TensorTable.build(columns, flags, chunk)
            self._tables[key] = (addresses, table)
        if capturing:
            self._kept.append(table)
        return table

    def update_tables(self, groups: dict) -> list:
        """The update's table of each group: key -> rows (target, grad, exp_avg, exp_avg_sq, copy or None, decay)."""
        tables = []
        for key, rows in groups.items():
            columns = [list(c) for c in zip(*[r[:4] for r in rows])]
            copies = [r[4] for r in rows]
            columns.append(None if copies[0] is None else copies)
            tables.append(self.table(("update",) + key, columns, [int(r[5]) for r in rows]))
        return tables

    def update(self, groups: dict, step: torch.Tensor, lr: torch.Tensor, hyper: Hyper,
               grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """One AdamW step of every group (``update_tables``' groups); step, lr, grad_scale, found_inf: fp32 [] on
        the groups' device."""
        adamw = kernels()
        for table in self.update_tables(groups):
            adamw.adamw_update(table, step, lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
                               grad_scale=grad_scale, found_inf=found_inf, tile=self._tile())

    def norm_tables(self, grads: list[torch.Tensor]) -> list[tuple[object, list[int]]]:
        """[(the table of one (device, dtype)'s gradients, their indices into ``grads``, rows without elements left
        out)]."""
        adamw = kernels()
        by_kind: dict = {}
        for i, g in enumerate(grads):
            by_kind.setdefault((g.device, g.dtype), []).append(i)
        out = []
        for key, idx in by_kind.items():
            column = [grads[i] for i in idx]
            out.append((self.table(("norm",) + key, [column]), [idx[r] for r in adamw.kept_rows([column])]))
        return out

    def sq_norms(self, grads: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
        """Each gradient's sum of squares in fp32, one launch pair per (device, dtype): [(sums [k], the indices into
        ``grads`` they belong to)]."""
        adamw = kernels()
        return [(adamw.grad_sq_norms(table, tile=self._tile()), idx) for table, idx in self.norm_tables(grads)]
