"""Peak dense matrix throughput per device, for MFU.

MFU = achieved model TFLOP/s / peak dense TFLOP/s of the compute dtype. Devices not in the
table report no MFU rather than a wrong one.
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name(), dense bf16/fp16 TFLOP/s without sparsity).
# Sources: vendor datasheets (NVIDIA H100/H200/B200/A100, AMD Instinct MI300X/MI325X/MI355X).
# More specific names come first: "H100 PCIe" must match before "H100".
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("GH200", 989.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("MI300X", 1307.4),
    ("MI325X", 1307.4),
    ("MI355X", 2516.6),
)


def peak_tflops(device_name: str | None, dtype: str) -> float | None:
    """Peak dense TFLOP/s for ``dtype`` ('bf16'/'fp16') on the named device, or None if unknown.

    fp32 training has no entry: its peak depends on TF32 settings, and a wrong MFU is worse
    than none.
    """
    if not device_name or dtype not in ("bf16", "fp16"):
        return None
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None
