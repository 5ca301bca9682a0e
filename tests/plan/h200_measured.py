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
