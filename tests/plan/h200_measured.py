"""`moetrain plan validate` on one H200 (torch 2.11, fresh process per config; moetrain/plan/VALIDATION.md),
the run of 2026-11-29 09:01 (bench/archive/planner-2026-11-29.md): the fused expert path for bf16 (tiny-wide and
qwen3-fp32 measured after run-time tuning stopped using do_bench's 256 MB L2-flush buffer and fp32 went back to the
torch path).

name -> (peak torch.cuda.max_memory_allocated GiB, median step time s). Step times differ by up to ~12%
between the machines we were lent (hosts by 1.9x: tiny-wide is host-bound).
"""

# Configs whose attention changed after these runs: the records measured GPT-OSS's sinks as an explicit fp32 softmax
# over [S, S + 1]; models.attention.sink_attention now runs them in the memory-efficient kernel, so the current-code
# comparisons skip them until a GPU run re-measures them.
MODEL_CHANGED_SINCE = {"gpt-oss-20b-4l"}

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

# 2026-11-29 10:43 (bench/archive/planner-2026-11-29.md), a fresh out-of-sample run on another lent H200 (same code
# as 09:01's):
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

# 2026-11-29 12:05 (bench/archive/planner-2026-11-29.md), out of sample after that run's refit (ELEMENTWISE, BWD_MEM,
# CE_FWD/CE_BWD fitted to scripts/plan_calibrate.py's layers and heads timed alone, none of these configs), with the
# tensor-core router GEMM. Same fields as H200_S3.
H200_S4 = {
    "tiny-wide": (0.32, 0.0539, {"dense": (0.00283, 0.00377), "moe": (0.00535, 0.00654)}),
    "qwen3-4l": (70.47, 0.1640, {"moe": (0.00400, 0.00860)}),
    "qwen3-4l-selective": (69.34, 0.1707, {"moe": (0.00411, 0.01084)}),
    "qwen3-4l-full": (66.48, 0.1726, {"moe": (0.00399, 0.01255)}),
    "qwen3-bf16-state": (35.65, 0.1151, {"moe": (0.00376, 0.00798)}),
    "qwen3-accum-bf16-moments": (49.78, 0.2520, {"moe": (0.00344, 0.00560)}),
    "qwen3-fp32": (28.94, 0.1730, {"moe": (0.01408, 0.02426)}),
    "deepseek-v3-2l": (88.75, 0.2722, {"dense": (0.01038, 0.02195), "moe": (0.01101, 0.02295)}),
    "deepseek-v3-2l-ids": (85.72, 0.2993, {"dense": (0.01031, 0.02332), "moe": (0.01131, 0.03402)}),
    "llama3-8b-4l": (50.99, 0.1865, {"dense": (0.00729, 0.01530)}),
    "mixtral-8x7b-2l": (56.93, 0.1118, {"moe": (0.00631, 0.01313)}),
    "gpt-oss-20b-4l": (86.79, 0.1774, {"moe": (0.00814, 0.01051)}),
}

# 2026-11-29 13:34, call E (moetrain/plan/VALIDATION.md): the trainer reads the next micro-batch while the GPU runs
# the backward
# (its steps lost ~5-13 ms of data work against the earlier runs), measured blocks include the main-grad hooks
# (measured_hooks). Same fields as H200_S3 plus the head timed alone. STEP_OVERHEAD_S was refitted (5 -> 1.4 ms) on
# that call's calibration configs before these were compared.
H200_S5 = {
    "tiny-wide": (0.32, 0.0591, {"dense": (0.00237, 0.00303), "moe": (0.00512, 0.00552), "head": (0.00045, 0.00075)}),
    "qwen3-4l": (70.47, 0.1406, {"moe": (0.00393, 0.01131), "head": (0.01511, 0.02038)}),
    "qwen3-4l-selective": (69.34, 0.1477, {"moe": (0.00392, 0.01291), "head": (0.01508, 0.02037)}),
    "qwen3-4l-full": (66.48, 0.1520, {"moe": (0.00384, 0.01465), "head": (0.01512, 0.02060)}),
    "qwen3-bf16-state": (35.65, 0.1054, {"moe": (0.00358, 0.00802), "head": (0.01515, 0.02089)}),
    "qwen3-accum-bf16-moments": (49.78, 0.2174, {"moe": (0.00224, 0.00727), "head": (0.00760, 0.01069)}),
    "qwen3-fp32": (28.94, 0.1568, {"moe": (0.01311, 0.02261), "head": (0.02584, 0.05013)}),
    "deepseek-v3-2l": (88.75, 0.2594, {"dense": (0.01029, 0.02425), "moe": (0.01091, 0.02617),
                                       "head": (0.01369, 0.02588)}),
    "deepseek-v3-2l-ids": (85.72, 0.2827, {"dense": (0.01032, 0.02572), "moe": (0.01091, 0.03682),
                                           "head": (0.01425, 0.02797)}),
    "llama3-8b-4l": (50.99, 0.1719, {"dense": (0.00733, 0.01630), "head": (0.01822, 0.02941)}),
    "mixtral-8x7b-2l": (56.93, 0.1009, {"moe": (0.00604, 0.01785), "head": (0.00246, 0.00433)}),
    "gpt-oss-20b-4l": (86.79, 0.1686, {"moe": (0.00830, 0.01353), "head": (0.00591, 0.01074)}),
}

# 2026-11-29 13:34, call F (moetrain/plan/VALIDATION.md): a fresh validate of the same code, another lent host (no
# refit between).
H200_S5_F = {
    "tiny-wide": (0.32, 0.0522, {"dense": (0.00248, 0.00414), "moe": (0.00479, 0.00639), "head": (0.00067, 0.00101)}),
    "qwen3-4l": (70.47, 0.1362, {"moe": (0.00393, 0.01077), "head": (0.01494, 0.02029)}),
    "qwen3-4l-selective": (69.34, 0.1495, {"moe": (0.00387, 0.01254), "head": (0.01496, 0.02064)}),
    "qwen3-4l-full": (66.48, 0.1567, {"moe": (0.00384, 0.01438), "head": (0.01498, 0.02049)}),
    "qwen3-bf16-state": (35.65, 0.1058, {"moe": (0.00364, 0.00778), "head": (0.01532, 0.02110)}),
    "qwen3-accum-bf16-moments": (49.78, 0.2164, {"moe": (0.00224, 0.00724), "head": (0.00753, 0.01069)}),
    "qwen3-fp32": (28.94, 0.1601, {"moe": (0.01413, 0.02349), "head": (0.02583, 0.04992)}),
    "deepseek-v3-2l": (88.75, 0.2628, {"dense": (0.01033, 0.02415), "moe": (0.01096, 0.02610),
                       "head": (0.01375, 0.02628)}),
    "deepseek-v3-2l-ids": (85.72, 0.2855, {"dense": (0.01046, 0.02572), "moe": (0.01113, 0.03733),
                           "head": (0.01470, 0.02915)}),
    "llama3-8b-4l": (50.99, 0.1732, {"dense": (0.00737, 0.01641), "head": (0.01801, 0.02988)}),
    "mixtral-8x7b-2l": (56.93, 0.1008, {"moe": (0.00607, 0.01789), "head": (0.00243, 0.00436)}),
    "gpt-oss-20b-4l": (86.79, 0.1671, {"moe": (0.00821, 0.01343), "head": (0.00588, 0.01079)}),
}

# 2026-11-29 14:55, call C (moetrain/plan/VALIDATION.md): the full validate after the router fix (its forward no longer
# scaled into
# the elementwise backward), same trainer as 13:34's for these eager configs; another lent host (a fast one: tiny-wide
# 38.6 ms). H200_S6_GRAPHS: train.cuda_graph with the update captured and one stream (calls D and E, two hosts),
# after STEP_OVERHEAD_GRAPH_S was fitted on the calibration configs cal-tiny-graph / cal-qwen3-2l-graph (call E).
# H200_S6_TINY_WIDE_STEPS: the eager tiny-wide on hosts D and E.
H200_S6 = {
    "tiny-wide": (0.32, 0.03855, {"dense": (0.001433, 0.002699), "moe": (0.003858, 0.004374), "head": (0.0006233, 0.0007556)}),
    "qwen3-4l": (70.47, 0.1418, {"moe": (0.004039, 0.01116), "head": (0.01504, 0.0205)}),
    "qwen3-4l-selective": (69.34, 0.1524, {"moe": (0.004015, 0.01291), "head": (0.01509, 0.02067)}),
    "qwen3-4l-full": (66.48, 0.1624, {"moe": (0.003914, 0.01464), "head": (0.0151, 0.0206)}),
    "qwen3-bf16-state": (35.65, 0.107, {"moe": (0.003703, 0.007921), "head": (0.01532, 0.02112)}),
    "qwen3-accum-bf16-moments": (49.78, 0.2137, {"moe": (0.00227, 0.007402), "head": (0.007582, 0.01069)}),
    "qwen3-fp32": (28.94, 0.1641, {"moe": (0.01377, 0.02396), "head": (0.02584, 0.04998)}),
    "deepseek-v3-2l": (88.75, 0.2633, {"dense": (0.01047, 0.02451), "moe": (0.01074, 0.02639), "head": (0.01384, 0.02606)}),
    "deepseek-v3-2l-ids": (85.72, 0.2865, {"dense": (0.01052, 0.02575), "moe": (0.01111, 0.0372), "head": (0.01464, 0.02907)}),
    "llama3-8b-4l": (50.99, 0.1751, {"dense": (0.007358, 0.01629), "head": (0.0182, 0.02955)}),
    "mixtral-8x7b-2l": (56.93, 0.1024, {"moe": (0.006135, 0.01826), "head": (0.002458, 0.004327)}),
    "gpt-oss-20b-4l": (86.79, 0.1676, {"moe": (0.008083, 0.01308), "head": (0.005963, 0.01094)}),
}
H200_S6_GRAPHS = {
    ("D", "tiny-wide-graph"): (0.32, 0.005938, {"dense": (0.0001906, 0.0004381), "moe": (0.0003883, 0.0006264), "head": (7.278e-05, 0.0001054)}),
    ("E", "tiny-wide-graph"): (0.32, 0.005942, {"dense": (0.000191, 0.0004432), "moe": (0.0003892, 0.0006297), "head": (7.358e-05, 0.0001049)}),
    ("E", "qwen3-4l-graph"): (70.47, 0.1384, {"moe": (0.003767, 0.0105), "head": (0.01505, 0.02054)}),
}
H200_S6_TINY_WIDE_STEPS = (0.05561, 0.04429)

# 2026-11-29 21:14, call D (`moetrain plan validate --steps 16`; moetrain/plan/VALIDATION.md): the current trainer,
# whose eager step
# clips inside the fused AdamW (grad_scale) instead of a separate scaling pass over the gradients; the earlier runs
# above had that pass. Same code for the graphed configs as 14:55's. Another lent host (tiny-wide 45.2 ms).
H200_S11 = {
    "tiny-wide": (0.32, 0.04523, {"dense": (0.001794, 0.003356), "moe": (0.003925, 0.00624), "head": (0.0004531, 0.0009312)}),
    "qwen3-4l": (70.47, 0.1409, {"moe": (0.003851, 0.01069), "head": (0.01501, 0.02055)}),
    "qwen3-4l-selective": (69.34, 0.1509, {"moe": (0.003855, 0.01239), "head": (0.01502, 0.02073)}),
    "qwen3-4l-full": (66.48, 0.1577, {"moe": (0.003813, 0.01437), "head": (0.01501, 0.02066)}),
    "qwen3-bf16-state": (35.65, 0.1101, {"moe": (0.003614, 0.008163), "head": (0.01541, 0.02107)}),
    "qwen3-accum-bf16-moments": (49.78, 0.2294, {"moe": (0.002885, 0.007615), "head": (0.007538, 0.01074)}),
    "qwen3-fp32": (28.94, 0.1614, {"moe": (0.01325, 0.0236), "head": (0.02584, 0.04997)}),
    "deepseek-v3-2l": (88.75, 0.2627, {"dense": (0.01037, 0.0245), "moe": (0.011, 0.02689), "head": (0.01374, 0.02635)}),
    "deepseek-v3-2l-ids": (85.72, 0.2849, {"dense": (0.01048, 0.02586), "moe": (0.01105, 0.03765), "head": (0.01476, 0.02892)}),
    "llama3-8b-4l": (50.99, 0.175, {"dense": (0.007407, 0.01649), "head": (0.01808, 0.0303)}),
    "mixtral-8x7b-2l": (56.87, 0.09836, {"moe": (0.006075, 0.01833), "head": (0.00244, 0.004313)}),
    "gpt-oss-20b-4l": (86.79, 0.1657, {"moe": (0.007869, 0.01306), "head": (0.005926, 0.01088)}),
}
H200_S11_GRAPHS = {
    "tiny-wide-graph": (0.32, 0.005934, {"dense": (0.0001914, 0.0004386), "moe": (0.0003372, 0.0006245), "head": (7.368e-05, 0.0001048)}),
    "qwen3-4l-graph": (70.47, 0.1386, {"moe": (0.003751, 0.01049), "head": (0.01499, 0.02044)}),
}

# host-bound: its step time is the host's eager launch speed, which differed 1.4x between the lent machines
# (0.054 / 0.065 / 0.076 s for the same code; 0.059-0.072 s on three hosts at 2026-11-29 13:34; 0.039 / 0.056 /
# 0.044 s at 14:55; 0.045 s at 21:14); a projection cannot be within 10% of all of them
HOST_BOUND = ("tiny-wide",)
