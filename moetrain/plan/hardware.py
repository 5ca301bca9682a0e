"""Hardware profiles for the planner: peak rates, memory, links.

A profile is a small YAML file (see ``profiles/*.yaml``; every number there carries its source
in a comment). ``load_hardware(NAME | PATH)`` accepts a built-in name (``h200-sxm``; a few
aliases such as ``h200`` work too) or the path of a user's own YAML file with the same keys.

Keys (units in the name): peak_tflops {bf16, fp16, fp8, tf32, fp32} dense TFLOP/s; hbm_gib
usable device memory; hbm_tbps memory bandwidth; gpus_per_node; intra_node_gbps and
inter_node_gbps per GPU per direction (GB/s); intra/inter_node_latency_us per collective step;
launch_overhead_us host time to launch one eager kernel; gemm_efficiency and hbm_efficiency the
fractions of the peaks that large GEMMs and copies really reach; optional ``measured`` numbers;
``sources``: for each key, where its number comes from (measured, datasheet, reference design,
assumption), reported by ``inputs``.

Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moetrain.errors import UserError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
ALIASES = {
    "h200": "h200-sxm", "h100": "h100-sxm", "a100": "a100-80gb-sxm", "a100-80gb": "a100-80gb-sxm",
    "mi300": "mi300x", "mi355": "mi355x", "b200-sxm": "b200",
}
REQUIRED = ("peak_tflops", "hbm_gib", "hbm_tbps", "gpus_per_node", "intra_node_gbps", "inter_node_gbps")
TIMING_KEYS = ("intra_node_latency_us", "inter_node_latency_us", "launch_overhead_us", "gemm_efficiency",
               "hbm_efficiency")


@dataclass
class Hardware:
    name: str
    peak_tflops: dict[str, float]
    hbm_gib: float
    hbm_tbps: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    description: str = ""
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 10.0
    launch_overhead_us: float = 12.0
    gemm_efficiency: float = 0.75
    hbm_efficiency: float = 0.85
    measured: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    source: str = ""

    def inputs(self) -> dict[str, list[str]]:
        """The profile's numbers grouped by where they come from (``sources``; "unstated" for a key without one,
        e.g. in a user's own profile). The ``measured`` numbers are measured on the profile's GPU."""
        out: dict[str, list[str]] = {}
        for key in REQUIRED + TIMING_KEYS:
            out.setdefault(self.sources.get(key, "unstated"), []).append(key)
        if self.measured:
            out.setdefault("measured", []).extend(f"measured.{k}" for k in self.measured)
        return out

    def peak(self, dtype: str) -> float:
        """Peak dense TFLOP/s for a compute dtype (fp32 matmuls without TF32 use ``fp32``)."""
        if dtype not in self.peak_tflops:
            have = ", ".join(sorted(self.peak_tflops))
            raise UserError(f"hardware {self.name} has no peak for {dtype} (it lists: {have})")
        return float(self.peak_tflops[dtype])

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2**30

    @property
    def mem_bw(self) -> float:
        """Achievable memory bandwidth in bytes/s (read + write counted)."""
        return self.hbm_tbps * 1e12 * self.hbm_efficiency

    def gemm_flops(self, dtype: str) -> float:
        """Achievable FLOP/s of large GEMMs in ``dtype``."""
        return self.peak(dtype) * 1e12 * self.gemm_efficiency


def list_builtin() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _from_dict(data: dict, source: str) -> Hardware:
    if not isinstance(data, dict):
        raise UserError(f"{source}: a hardware profile must be a YAML mapping")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise UserError(f"{source}: hardware profile lacks {', '.join(missing)} (required: {', '.join(REQUIRED)})")
    known = set(Hardware.__dataclass_fields__) - {"source"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{source}: unknown hardware key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks:
        raise UserError(f"{source}: peak_tflops must map dtypes (bf16, fp16, fp8, tf32, fp32) to TFLOP/s")
    hw = Hardware(**{k: v for k, v in data.items()}, source=source)
    hw.name = str(data.get("name", Path(source).stem))
    for key in ("hbm_gib", "hbm_tbps", "intra_node_gbps", "inter_node_gbps", "gpus_per_node"):
        if not isinstance(getattr(hw, key), (int, float)) or getattr(hw, key) <= 0:
            raise UserError(f"{source}: {key} = {getattr(hw, key)!r} must be a positive number")
    return hw


def load_hardware(spec: str | None) -> Hardware:
    """A built-in profile by name (default h200-sxm) or a user YAML file by path."""
    spec = spec or "h200-sxm"
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise UserError(f"hardware profile file not found: {spec}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise UserError(f"{spec}: invalid YAML ({str(err).splitlines()[0]})") from None
        return _from_dict(data, str(path))
    name = ALIASES.get(spec.lower(), spec.lower())
    builtin = PROFILE_DIR / f"{name}.yaml"
    if not builtin.is_file():
        raise UserError(f"unknown hardware {spec!r}; built-in: {', '.join(list_builtin())} (or a YAML file path)")
    return _from_dict(yaml.safe_load(builtin.read_text()), name)
