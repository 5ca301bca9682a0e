"""Run-time infrastructure below the kernels: device properties (cuda_device), CUDA-event timing (timing) and the
on-disk measurement caches (disk_cache). Plain Python and torch: nothing here imports triton, ops or models."""
