"""Run by test_jax_expert_parallel.py in its own process (2 host devices, fixed when jax starts), one JSON line per
case:

* "model": a family's loss and gradients on one device and with expert parallelism over the 2-device mesh, jitted;
* "train": the tiny preset trained with train.backend=jax on one device and over 2 devices (parallel.dp=2, with and
  without parallel.ep=2) on the same global batches, then the EP run resumed from its step-2 checkpoint.
"""

import json
import logging
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + os.environ.get("XLA_FLAGS", "")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from test_models import batch, build  # noqa: E402

from moetrain.config.load import load_config  # noqa: E402
from moetrain.jax import convert  # noqa: E402
from moetrain.jax.expert_parallel import apply_expert_parallel  # noqa: E402
from moetrain.jax.model import MoETransformer  # noqa: E402
from moetrain.train.trainer import run  # noqa: E402


@nnx.jit
def loss_and_grads(model, ids, labels):
    def f(m):
        out = m(ids, labels)
        return out.loss, out

    (_, out), grads = nnx.value_and_grad(f, has_aux=True)(model)
    return out.loss, grads


def model_case(name: str, capacity: float | None) -> dict:
    tmodel = build(name, 0)
    if capacity is not None:
        tmodel.cfg.moe.capacity_factor = capacity
    one, two = (MoETransformer(tmodel.cfg, rngs=nnx.Rngs(0)) for _ in range(2))
    convert.from_torch(tmodel, one)
    convert.from_torch(tmodel, two)
    apply_expert_parallel(two, Mesh(np.array(jax.devices()[:2]), ("ep",)))
    ids, labels = (jnp.asarray(t.numpy()) for t in batch(seed=1))
    loss1, g1 = loss_and_grads(one, ids, labels)
    loss2, g2 = loss_and_grads(two, ids, labels)
    flat1 = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(g1)}
    flat2 = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(g2)}
    rel = max(float(np.linalg.norm(flat1[k] - flat2[k]) / max(np.linalg.norm(flat1[k]), 1e-30)) for k in flat1)
    w1 = two.moe_layers()[0].experts.w1[...]
    return {"kind": "model", "name": name, "loss1": float(loss1), "loss2": float(loss2), "grad_rel": rel,
            "w1_devices": len(w1.sharding.device_set), "same_keys": set(flat1) == set(flat2)}


class CompileCounter(logging.Handler):
    """Counts jax's "Compiling jit(NAME) ..." log lines (jax_log_compiles) by NAME."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling jit("):
            name = msg[len("Compiling jit("):].split(")", 1)[0]
            self.counts[name] = self.counts.get(name, 0) + 1


def train_case(name: str, out_dir: str, *extra: str) -> dict:
    cfg = load_config(overrides=[
        f"train.out_dir={out_dir}", "train.steps=3", "train.global_batch_size=8", "train.seq_length=32",
        "optim.warmup_steps=1", "train.backend=jax", "checkpoint.interval=2", *extra])
    counter = CompileCounter()
    logging.getLogger("jax").addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    try:
        records = run(cfg, show_progress=False).records
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(counter)
    return {"kind": "train", "name": name, "steps": [r["step"] for r in records],
            "loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "compiles": {k: counter.counts.get(k, 0) for k in ("grads", "update")}}


if __name__ == "__main__":
    assert len(jax.devices()) == 2, jax.devices()
    root = sys.argv[1]
    cases = [lambda: model_case("deepseek", None), lambda: model_case("gptoss", None),
             lambda: model_case("mixtral", 0.5),
             lambda: train_case("one", f"{root}/one", "train.micro_batch_size=4"),
             lambda: train_case("dp2", f"{root}/dp2", "train.micro_batch_size=2", "parallel.dp=2"),
             lambda: train_case("dp2ep2", f"{root}/ep", "train.micro_batch_size=2", "parallel.dp=2", "parallel.ep=2"),
             lambda: train_case("dp2ep2_resumed", f"{root}/ep", "train.micro_batch_size=2", "parallel.dp=2",
                                "parallel.ep=2", f"checkpoint.resume={root}/ep/checkpoints/step_2")]
    for case in cases:
        print(json.dumps(case()), flush=True)
