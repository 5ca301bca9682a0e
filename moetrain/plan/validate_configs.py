"""The built-in configurations of `moetrain plan validate` (pure data, no torch).

Each entry: (preset, dotted overrides). Together they cover dense and MoE models, GQA (with qk
norm, sinks, sliding windows, biases) and MLA, shared experts, MTP, top-k 2..8, micro-batch
1..16, sequence 512..4096, gradient accumulation, recompute none / selective / full / explicit
ids, a CUDA-graphed step, and precision variants (bf16 with fp32 state, bf16 state, fp32 master with bf16 moments,
fp32). Depths and expert counts are reduced so that each fits one 140 GiB GPU and runs in
seconds.
"""

from __future__ import annotations

_QW = ["model.num_layers=4", "train.seq_length=4096", "train.micro_batch_size=2", "train.global_batch_size=2"]
_DS = ["model.num_layers=2", "moe.first_k_dense=1", "moe.num_experts=16", "train.seq_length=4096",
       "train.micro_batch_size=1", "train.global_batch_size=1"]

VALIDATION_CONFIGS: dict[str, tuple[str, list[str]]] = {
    "tiny-wide": ("tiny", ["train.seq_length=512", "train.micro_batch_size=16", "train.global_batch_size=16"]),
    # the same step replayed from CUDA graphs (train.cuda_graph): no longer host-bound
    "tiny-wide-graph": ("tiny", ["train.seq_length=512", "train.micro_batch_size=16", "train.global_batch_size=16",
                                 "train.cuda_graph=true"]),
    "qwen3-4l": ("qwen3-30b-a3b", _QW),
    "qwen3-4l-graph": ("qwen3-30b-a3b", _QW + ["train.cuda_graph=true"]),
    "qwen3-4l-selective": ("qwen3-30b-a3b", _QW + ["train.recompute=selective"]),
    "qwen3-4l-full": ("qwen3-30b-a3b", _QW + ["train.recompute=full"]),
    "qwen3-bf16-state": ("qwen3-30b-a3b", ["model.num_layers=4", "train.seq_length=2048", "train.micro_batch_size=4",
                                           "train.global_batch_size=4", "precision.master_weights=false",
                                           "optim.main_grads_dtype=bf16", "optim.exp_avg_dtype=bf16",
                                           "optim.exp_avg_sq_dtype=bf16"]),
    "qwen3-accum-bf16-moments": ("qwen3-30b-a3b", ["model.num_layers=4", "train.seq_length=4096",
                                                   "train.micro_batch_size=1", "train.global_batch_size=2",
                                                   "optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"]),
    "qwen3-fp32": ("qwen3-30b-a3b", ["model.num_layers=2", "train.seq_length=2048", "train.micro_batch_size=1",
                                     "train.global_batch_size=1", "precision.dtype=fp32"]),
    "deepseek-v3-2l": ("deepseek-v3", _DS),
    "deepseek-v3-2l-ids": ("deepseek-v3", _DS + ["train.recompute=selective", "train.recompute_layer_ids=[1,2]"]),
    "llama3-8b-4l": ("llama3-8b", ["model.num_layers=4", "train.seq_length=4096", "train.micro_batch_size=2",
                                   "train.global_batch_size=2"]),
    "mixtral-8x7b-2l": ("mixtral-8x7b", ["model.num_layers=2", "train.seq_length=4096", "train.micro_batch_size=1",
                                         "train.global_batch_size=1"]),
    "gpt-oss-20b-4l": ("gpt-oss-20b", ["model.num_layers=4", "train.seq_length=2048", "train.micro_batch_size=1",
                                       "train.global_batch_size=1"]),
}
CONFIG_NAMES = list(VALIDATION_CONFIGS)

# Calibration configs: what the planner's constants are fitted to (scripts/plan_calibrate.py has the eager ones).
# `plan validate --configs NAME` runs them like the validation configs; the default run leaves them out, and no
# validation config is among them, so the validation table stays out of sample.
CALIBRATION_CONFIGS: dict[str, tuple[str, list[str]]] = {
    # train.cuda_graph's per-step host time (perf.STEP_OVERHEAD_GRAPH_S): a small and a GPU-bound graphed step
    "cal-tiny-graph": ("tiny", ["train.seq_length=1024", "train.micro_batch_size=4", "train.global_batch_size=4",
                                "train.cuda_graph=true"]),
    "cal-qwen3-2l-graph": ("qwen3-30b-a3b", ["model.num_layers=2", "train.seq_length=2048", "train.micro_batch_size=2",
                                            "train.global_batch_size=2", "train.cuda_graph=true"]),
}
ALL_CONFIGS = {**VALIDATION_CONFIGS, **CALIBRATION_CONFIGS}
