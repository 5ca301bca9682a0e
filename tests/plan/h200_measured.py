"""`moetrain plan validate` on one H200 (torch 2.11, fresh process per config; moetrain/plan/VALIDATION.md),
session 2: the fused expert path for bf16 (tiny-wide and qwen3-fp32 measured after run-time tuning
stopped using do_bench's 256 MB L2-flush buffer and fp32 went back to the torch path).

name -> (peak torch.cuda.max_memory_allocated GiB, median step time s). Step times differ by up to ~12%
between the machines we were lent (hosts by 1.9x: tiny-wide is host-bound).
"""

H200 = {
    "tiny-wide": (0.335, 0.0758),
    "qwen3-4l": (71.71, 0.1659),
    "qwen3-4l-selective": (69.58, 0.1846),
    "qwen3-4l-full": (66.48, 0.1780),
    "qwen3-bf16-state": (36.89, 0.1298),
    "qwen3-accum-bf16-moments": (50.40, 0.2400),
    "qwen3-fp32": (28.94, 0.1749),
    "deepseek-v3-2l": (89.84, 0.2928),
    "deepseek-v3-2l-ids": (85.72, 0.3044),
    "llama3-8b-4l": (50.99, 0.1882),
    "mixtral-8x7b-2l": (57.37, 0.1179),
    "gpt-oss-20b-4l": (86.88, 0.1713),
}

# Session 3, a fresh out-of-sample run on another lent H200 (same code as session 2's; scripts/h200_next_a.sh):
# name -> (peak GiB, median step s, {block kind: (forward s, backward s)} from measure_blocks).
H200_S3 = {
    "tiny-wide": (0.34, 0.0653, {"dense": (0.00257, 0.00369), "moe": (0.00566, 0.00500)}),
    "qwen3-4l": (71.71, 0.1584, {"moe": (0.00412, 0.00902)}),
    "qwen3-4l-selective": (69.58, 0.1610, {"moe": (0.00413, 0.01078)}),
    "qwen3-4l-full": (66.48, 0.1707, {"moe": (0.00401, 0.01368)}),
    "qwen3-bf16-state": (36.89, 0.1177, {"moe": (0.00379, 0.00812)}),
    "qwen3-accum-bf16-moments": (50.40, 0.2426, {"moe": (0.00336, 0.00558)}),
    "qwen3-fp32": (28.94, 0.1756, {"moe": (0.01414, 0.02343)}),
    "deepseek-v3-2l": (89.84, 0.2669, {"dense": (0.01044, 0.02214), "moe": (0.01118, 0.02294)}),
    "deepseek-v3-2l-ids": (85.72, 0.2891, {"dense": (0.01031, 0.02302), "moe": (0.01120, 0.03388)}),
    "llama3-8b-4l": (50.99, 0.1939, {"dense": (0.00717, 0.01518)}),
    "mixtral-8x7b-2l": (57.12, 0.1168, {"moe": (0.00639, 0.01289)}),
    "gpt-oss-20b-4l": (86.88, 0.1727, {"moe": (0.00847, 0.01083)}),
}

# What these runs had that later code changed: the router's logits GEMM was the fp32 one (the planner
# follows moe.router_gemm), so replays project with it.
AS_MEASURED = ("moe.router_gemm=fp32",)
