"""The one run-time tuner: which kernel runs an op at a shape, measured once and reused.

A question is (op kind, dtype, N, K, rows-per-group bucket, variant flags, GPU); its candidates are whatever can run
it, every (backend x config) pair alike: torch._grouped_mm is an ordinary candidate of the grouped GEMMs, beside each
of our kernels' tile configs; the fused MoE path's variants (gather / copy, separate / fused) are candidates of
theirs. One timing protocol (protocol.py), one cache file (cache.py), one version; the timer is passed to the Tuner.
Under torch.distributed, rank 0 decides and broadcasts (agree.py), so every rank runs the same kernels.

    from moetrain import tuning
    choice = tuning.choose("gemm_fwd+torch", x, n, k, rows, groups, candidates, runs)

``tuning.active()`` is the process's Tuner; ``tuning.use(Tuner(timer=...))`` installs another (tests, benchmarks).
"""

from moetrain.tuning.tuner import Decision, Tuner, active, choose, reset, use  # noqa: F401
