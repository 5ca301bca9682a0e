"""`moetrain train train.backend=jax`: the torch trainer's loop, run dir, data, metrics and checkpoints around a
JAX model and jitted step functions.

``JaxTrainer`` subclasses ``train.trainer.Trainer`` and replaces the parts that touch the model: building it,
the optimizer step, evaluation. Everything the user sees is shared: the progress output, metrics.jsonl, the
checkpoint files (the torch trainer's format, written atomically and verified on resume by the same code), Ctrl-C
handling and resume. The checkpoint holds torch tensors under the torch model's parameter names, so a run trained
in one backend resumes, weights and optimizer state, in the other. (One format for both backends is why this is not
orbax: orbax's sharded, asynchronous saves are what multi-host JAX runs will need, and will write the same names.)

One optimizer step: for each micro-batch a jitted ``grads`` (forward + backward of the loss, the MoE load counts
updated), the gradients summed in fp32 and divided by the micro-batch count; then a jitted ``update`` (global norm,
clip, AdamW, the expert-bias update, all withheld where the loss or the norm is not finite) and one host read of
the step's numbers. Parameters compute in precision.dtype on a GPU and fp32 on the CPU; with bf16 and
precision.master_weights the optimizer updates fp32 masters and the model gets their bf16 copy.

With parallel.dp > 1 the step runs over that many devices of this process (``moetrain.jax.mesh``: micro-batches of
dp x micro_batch_size split over them, FSDP-style weights, experts over parallel.ep); the numbers are one device's
on the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.errors import UserError
from moetrain.jax import mesh as jax_mesh
from moetrain.jax.convert import persistent_name
from moetrain.jax import optim as jax_optim
from moetrain.jax.expert_parallel import apply_expert_parallel
from moetrain.jax.model import MoETransformer
from moetrain.jax.state import ModelState, cast
from moetrain.train.lr import lr_at
from moetrain.train.steps import StepResult
from moetrain.train.trainer import Trainer


def check_supported(cfg) -> None:
    """One error for every setting the JAX backend does not run (nothing falls back silently)."""
    t, p = cfg.train, cfg.precision
    refused = {
        "precision.fp8_recipe": p.fp8_recipe != "none", "precision.fp8_dense": p.fp8_dense != "none",
        "train.compile": t.compile, "train.cuda_graph": t.cuda_graph, "train.fused_loss": t.fused_loss,
        "moe.force_balance": cfg.is_moe and cfg.moe.force_balance != "none",
        "moe.backend": cfg.is_moe and cfg.moe.backend != "auto",
    }
    bad = [k for k, on in refused.items() if on]
    if bad:
        raise UserError(f"train.backend=jax does not run {', '.join(bad)} (set by this config); leave them at their "
                        "defaults or train with train.backend=torch")


def jax_dtype(cfg):
    """The parameters' compute dtype: precision.dtype on a GPU, fp32 on the CPU (as the torch trainer)."""
    if jax.default_backend() == "cpu":
        return jnp.float32
    return jax_optim.JNP_DTYPES[cfg.precision.dtype]


@dataclass
class JaxModelHandle:
    """The model as the loop and the checkpoint code see it: torch-named state dicts in and out."""

    state: ModelState
    dtype: object
    masters: bool  # params are fp32 masters of bf16/fp16 compute weights
    moe_prefixes: list[str]  # "layers.3.mlp.", ...: the MoE layers in block order (the load-imbalance order)
    mesh: object = None  # a jax_mesh mesh with parallel.dp > 1, else None (one device)

    def place(self) -> None:
        """Parameters and buffers on the mesh (mesh.py's shardings; buffers replicated); nothing on one device."""
        if self.mesh is not None:
            self.state.params = jax_mesh.place(self.state.params, self.mesh)
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            self.state.buffers = {k: jax.device_put(v, replicated) for k, v in self.state.buffers.items()}

    def batch(self, tensor) -> jax.Array:
        """A CPU torch batch [B, S] as a device array, split over the mesh's devices where there is one."""
        array = jnp.asarray(tensor.numpy())
        return array if self.mesh is None else jax.device_put(array, jax_mesh.batch_sharding(self.mesh))

    def compute_params(self) -> dict:
        return cast(self.state.params, self.dtype) if self.masters else self.state.params

    def state_dict(self) -> dict:
        """Compute-dtype parameters and the expert biases as CPU torch tensors (tokens_per_expert is not kept)."""
        out = {k: jax_optim.to_torch(v) for k, v in self.compute_params().items()}
        out.update({k: jax_optim.to_torch(v) for k, v in self.state.buffers.items() if persistent_name(k)})
        return out

    def load_state_dict(self, sd: dict) -> None:
        for k, v in self.state.params.items():
            self.state.params[k] = jax_optim.from_torch(sd[k], v.dtype)
        for k, v in self.state.buffers.items():
            if persistent_name(k):
                self.state.buffers[k] = jax_optim.from_torch(sd[k], v.dtype)
        self.place()

    def parameters(self):
        return iter(())  # nothing here is a torch DTensor (the checkpoint code asks)


class JaxOptimizer:
    """optax state plus the torch optimizer's checkpoint interface."""

    def __init__(self, handle: JaxModelHandle, optim):
        self.handle = handle
        self.tx = jax_optim.make(handle.state.params, optim)
        self.opt_state = self.tx.init(handle.state.params)
        if handle.mesh is not None:
            self.opt_state = jax_optim.place_moments(self.opt_state, handle.mesh)

    def state_dict(self) -> dict:
        return jax_optim.state_dict(self.opt_state, self.handle.state.params, self.handle.masters)

    def load_state_dict(self, state: dict) -> None:
        self.opt_state, self.handle.state.params = jax_optim.load_state_dict(
            self.opt_state, self.handle.state.params, state, self.handle.masters)
        self.handle.place()
        if self.handle.mesh is not None:  # the moments where their parameters are
            self.opt_state = jax_optim.place_moments(self.opt_state, self.handle.mesh)

    def close(self) -> None:
        pass


class JaxTrainer(Trainer):
    """The training loop on a JAX model, on one device or a mesh of this process's devices (see the module doc)."""

    def check_layout(self) -> None:
        from moetrain.jax import require_jax

        require_jax()
        p = self.cfg.parallel
        multi = [f"parallel.{k} = {getattr(p, k)}" for k in ("dp_replicate", "tp", "pp", "vpp", "cp", "etp")
                 if getattr(p, k) > 1]
        if multi:
            raise UserError(f"{', '.join(multi)}: train.backend=jax runs data and expert parallelism (parallel.dp, "
                            "parallel.ep) only; set these to 1 or train with train.backend=torch")
        check_supported(self.cfg)
        self.gpus = p.dp

    def choose_device(self):
        import torch

        return torch.device("cpu")  # torch holds no model state here: JAX places the arrays

    def _set_up(self) -> None:
        super()._set_up()
        from moetrain.train.data import BatchAhead
        from moetrain.train.throughput import peak_tflops

        # one process reads every data rank's rows: micro-batches of dp x micro_batch_size, split over the mesh
        self.batches = BatchAhead(self.batches.data, self.cfg.train.micro_batch_size * self.cfg.parallel.dp)

        dev = jax.devices()[0]
        if dev.platform == "gpu":
            self.device_name = dev.device_kind
            self.peak_tflops = peak_tflops(dev.device_kind, self.cfg.precision.dtype)

    def _log_start(self) -> None:
        super()._log_start()
        dev = jax.devices()[0]
        self.display.log(f"train.backend=jax: jax {jax.__version__} on {dev.device_kind} ({dev.platform}), "
                         f"parameters in {jnp.dtype(self.model.dtype).name}"
                         f"{' with fp32 masters' if self.model.masters else ''}; the first step compiles")

    def _record(self, step: int, result: StepResult, elapsed: float) -> dict:
        record = super()._record(step, result, elapsed)
        stats = jax.devices()[0].memory_stats() if jax.devices()[0].platform == "gpu" else None
        if stats and "peak_bytes_in_use" in stats:
            record["peak_mem_gib"] = stats["peak_bytes_in_use"] / 2**30
        return record

    def build_model(self) -> JaxModelHandle:
        cfg = self.cfg
        dtype = jax_dtype(cfg)
        masters = dtype != jnp.float32 and cfg.precision.master_weights
        module = MoETransformer(cfg, rngs=nnx.Rngs(cfg.train.seed), dtype=jnp.float32 if masters else dtype)
        if cfg.model.from_hf and not self.start.candidates:  # initial weights from HF (a resume overwrites them)
            self._load_hf(module)
        mesh = None
        if cfg.parallel.dp > 1:
            mesh = jax_mesh.build_mesh(cfg.parallel)
            if cfg.parallel.ep > 1 and cfg.is_moe:
                apply_expert_parallel(module, mesh, "ep")
        prefixes = [f"{'layers' if gid < cfg.model.num_layers else 'mtp'}."
                    f"{gid if gid < cfg.model.num_layers else f'{gid - cfg.model.num_layers}.block'}.mlp."
                    for gid, blk in module.blocks() if blk.is_moe]
        handle = JaxModelHandle(ModelState.of(module), dtype, masters, prefixes, mesh)
        handle.place()
        jax_optim.check_precision(cfg.optim, jnp.float32 if masters else dtype)
        self._compile_steps(handle)
        return handle

    def _load_hf(self, module: MoETransformer) -> None:
        """model.from_hf's weights through the torch model's importer (HF names, layouts, MLA's de-interleaved
        RoPE rows), then moved by name."""
        from moetrain.jax import convert
        from moetrain.models import build_model as build_torch_model
        from moetrain.models.hf import load_hf_weights

        torch_model = build_torch_model(self.cfg)
        load_hf_weights(torch_model, self.cfg.model.from_hf, progress=self.show_progress)
        convert.from_torch(torch_model, module)

    def build_optimizer(self) -> JaxOptimizer:
        return JaxOptimizer(self.model, self.cfg.optim)

    def _step_modes(self):
        return None, None

    def _compile_steps(self, handle: JaxModelHandle) -> None:
        cfg, state = self.cfg, handle.state
        dtype, masters = handle.dtype, handle.masters
        grad_dtype = jnp.float32 if masters else jax_optim.JNP_DTYPES[cfg.optim.main_grads_dtype]
        bias_rate = cfg.moe.expert_bias_update_rate if cfg.is_moe and cfg.moe.expert_bias else None
        clip = cfg.optim.clip_grad

        def loss_terms(params, buffers, ids, labels):
            model = state.merge(cast(params, dtype) if masters else params, buffers)
            out = model(ids, labels)
            mtp = out.mtp_loss if out.mtp_loss is not None else jnp.zeros((), jnp.float32)
            terms = jnp.stack([out.loss, out.lm_loss, out.aux_loss, mtp]).astype(jnp.float32)
            return out.loss, (terms, state.buffers_of(model))

        def grads(params, buffers, ids, labels, grad_sums):
            (_, (terms, buffers)), g = jax.value_and_grad(loss_terms, has_aux=True)(params, buffers, ids, labels)
            return {k: grad_sums[k] + v.astype(grad_dtype) for k, v in g.items()}, terms, buffers

        def update(params, opt_state, buffers, grad_sums, terms, lr, accum):
            g = {k: v / accum for k, v in grad_sums.items()}
            new_params, new_opt, norm = jax_optim.apply(self.optimizer.tx, params, opt_state, g, lr, clip)
            keep = jnp.isfinite(terms[0]) & jnp.isfinite(norm)
            params = jax.tree.map(lambda new, old: jnp.where(keep, new, old), new_params, params)
            opt_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), new_opt, opt_state)
            buffers, imbalance = _expert_bias_step(buffers, handle.moe_prefixes, bias_rate, keep)
            if handle.mesh is not None:  # back on the shardings they came in on: the next step reuses this program
                params = jax_mesh.constrain(params, handle.mesh)
                opt_state = jax_optim.constrain_moments(opt_state, handle.mesh)
            return params, opt_state, buffers, norm, keep, imbalance

        # Donated: the gradient sums are added to in place, and the update writes the parameters and the optimizer
        # state over the old ones (without donation a step held both: +1x the parameters and +2x in Adam state).
        self._grads = jax.jit(grads, donate_argnames=("grad_sums",))
        self._update = jax.jit(update, static_argnames=("accum",), donate_argnames=("params", "opt_state"))
        self._grad_dtype = grad_dtype
        self._terms = jax.jit(loss_terms)

    def train_step(self, step: int) -> StepResult:
        cfg, handle, opt = self.cfg, self.model, self.optimizer
        lr = lr_at(step - 1, cfg.optim, cfg.train.steps)
        buffers = _zero_counts(handle.state.buffers)
        # zeros_like keeps each parameter's sharding and committedness: the compiled step sees the same inputs
        grad_sums = {k: jnp.zeros_like(v, dtype=self._grad_dtype) for k, v in handle.state.params.items()}
        term_sums = jnp.zeros(4, jnp.float32)
        for input_ids, labels in self.micro_batches():
            grad_sums, terms, buffers = self._grads(handle.state.params, buffers, handle.batch(input_ids),
                                                    handle.batch(labels), grad_sums)
            term_sums = term_sums + terms
        terms = term_sums / self.accum
        params, opt.opt_state, buffers, norm, keep, imbalance = self._update(
            handle.state.params, opt.opt_state, buffers, grad_sums, terms, jnp.float32(lr), accum=self.accum)
        handle.state.params, handle.state.buffers = params, buffers
        host = jax.device_get((terms, norm, keep, imbalance))  # the step's one read (waits for its end)
        (loss, lm_loss, aux_loss, mtp_loss), norm, keep, imbalance = host
        skipped = not bool(keep)
        return StepResult(float(loss), float(lm_loss), float(aux_loss), float(mtp_loss), float(norm), skipped,
                          [round(float(v), 6) for v in imbalance], lr, tokens=self.tokens_per_step)

    def evaluate(self) -> float:
        """Mean LM loss over train.eval_steps micro-batches of the eval split (the load counts untouched)."""
        from moetrain.train.data import build_data

        cfg, handle = self.cfg, self.model
        data = build_data(cfg, cfg.model.vocab_size, "eval")
        total = 0.0
        for _ in range(cfg.train.eval_steps):
            input_ids, labels = data.next_batch(cfg.train.micro_batch_size)
            _, (terms, _) = self._terms(handle.state.params, handle.state.buffers, handle.batch(input_ids),
                                        handle.batch(labels))
            total += float(terms[1])
        return total / cfg.train.eval_steps


def _zero_counts(buffers: dict) -> dict:
    return {k: jnp.zeros_like(v) if k.endswith("tokens_per_expert") else v for k, v in buffers.items()}


def _expert_bias_step(buffers: dict, prefixes: list[str], rate: float | None, keep: jax.Array):
    """(buffers with each router's expert_bias moved by rate * sign(mean - count) where ``keep``, the max/mean load
    of each MoE layer [len(prefixes)]) from the step's tokens_per_expert."""
    out = dict(buffers)
    imbalance = []
    for prefix in prefixes:
        c = buffers[prefix + "tokens_per_expert"]
        imbalance.append(c.max() / jnp.maximum(c.mean(), 1e-12))
        bias_key = prefix + "router.expert_bias"
        if rate is not None and bias_key in out:
            out[bias_key] = out[bias_key] + jnp.where(keep, rate * jnp.sign(c.mean() - c), 0.0)
    return out, jnp.stack(imbalance) if imbalance else jnp.zeros(0, jnp.float32)
