"""Run by test_jax_expert_parallel.py in its own process (2 host devices, fixed when jax starts): the tiny preset
trained 4 steps with train.backend=jax on one device and over 2 devices (parallel.dp=2, with and without
parallel.ep=2), on the same global batches; then the EP run resumed from its step-2 checkpoint. Prints one JSON line
per run: its losses and gradient norms."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

from moetrain.config.load import load_config  # noqa: E402
from moetrain.train.trainer import run  # noqa: E402


def train(out_dir: str, *extra: str) -> dict:
    cfg = load_config(overrides=[
        f"train.out_dir={out_dir}", "train.steps=4", "train.global_batch_size=8", "train.seq_length=32",
        "optim.warmup_steps=1", "train.backend=jax", "checkpoint.interval=2", *extra])
    records = run(cfg, show_progress=False).records
    return {"steps": [r["step"] for r in records], "loss": [r["loss"] for r in records],
            "grad_norm": [r["grad_norm"] for r in records], "imbalance": records[-1]["load_imbalance"]}


if __name__ == "__main__":
    root = sys.argv[1]
    runs = {
        "one": train(f"{root}/one", "train.micro_batch_size=4"),
        "dp2": train(f"{root}/dp2", "train.micro_batch_size=2", "parallel.dp=2"),
        "dp2ep2": train(f"{root}/ep", "train.micro_batch_size=2", "parallel.dp=2", "parallel.ep=2"),
    }
    runs["dp2ep2_resumed"] = train(f"{root}/ep", "train.micro_batch_size=2", "parallel.dp=2", "parallel.ep=2",
                                   f"checkpoint.resume={root}/ep/checkpoints/step_2")
    for name, result in runs.items():
        print(json.dumps({"name": name, **result}), flush=True)
