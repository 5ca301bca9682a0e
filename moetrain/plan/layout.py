"""Pipeline stage placement: the stages of ``parallel.pipeline_layout`` (or the default split) on ranks.

The grammar and its rules live in ``moetrain.config.pipeline_layout`` (``Config.check`` applies
them when a config is loaded); a layout has exactly parallel.pp x parallel.vpp stages. Stage i runs on the pipeline rank
``config.pipeline_layout.stage_rank`` gives for parallel.pp_schedule (looped: i mod pp; V: i, then
2 pp - 1 - i), as its virtual chunk i // pp.

Without a layout: pp * vpp stages with the decoder layers split evenly (Config.check demands
divisibility), E on the first stage, the MTP depths and L on the last.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrain.config import pipeline_layout
from moetrain.config.pipeline_layout import KEY, LETTERS, expand, layout_stages, stage_rank  # noqa: F401
from moetrain.config.schema import Config


@dataclass
class Stage:
    index: int  # position in the pipeline, 0-based
    rank: int  # pipeline rank (stage_rank: index % pp, or the V placement)
    chunk: int  # virtual chunk on that rank = index // pp
    items: list[str] = field(default_factory=list)  # 'E', 't', 'm', 'L' in order
    layers: list[int] = field(default_factory=list)  # global decoder layer ids
    mtp: list[int] = field(default_factory=list)  # MTP depths, 0-based

    @property
    def has_embedding(self) -> bool:
        return "E" in self.items

    @property
    def has_loss(self) -> bool:
        return "L" in self.items

    def block_ids(self, num_layers: int) -> list[int]:
        """Global block ids (decoder layers, then MTP depth d as num_layers + d)."""
        return self.layers + [num_layers + d for d in self.mtp]

    def describe(self) -> str:
        parts = []
        if self.has_embedding:
            parts.append("E")
        if self.layers:
            first, last = self.layers[0], self.layers[-1]
            parts.append(f"t{first}" if first == last else f"t{first}-{last}")
        parts += [f"m{d}" for d in self.mtp]
        if self.has_loss:
            parts.append("L")
        return " ".join(parts) or "(empty)"


@dataclass
class Layout:
    stages: list[Stage]
    pp: int
    vpp: int
    text: str

    def stages_of_rank(self, rank: int) -> list[Stage]:
        return [s for s in self.stages if s.rank == rank]


def parse_layout(cfg: Config) -> Layout:
    """The stage layout of ``cfg`` (explicit ``parallel.pipeline_layout`` or the default)."""
    p, m = cfg.parallel, cfg.model
    if p.pipeline_layout is None:
        return default_layout(cfg)
    stages = layout_stages(p.pipeline_layout, num_layers=m.num_layers, mtp_num_layers=m.mtp_num_layers,
                           pp=p.pp, vpp=p.vpp)
    return _build(stages, p.pp, p.vpp, p.pipeline_layout, p.pp_schedule)


def default_layout(cfg: Config) -> Layout:
    p, m = cfg.parallel, cfg.model
    text = pipeline_layout.default_layout(m.num_layers, m.mtp_num_layers, p.pp * p.vpp)
    return _build(expand(text), p.pp, p.vpp, text, p.pp_schedule)


def _build(stages_txt: list[str], pp: int, vpp: int, text: str, schedule: str) -> Layout:
    stages, layer, depth = [], 0, 0
    for i, txt in enumerate(stages_txt):
        st = Stage(index=i, rank=stage_rank(i, pp, schedule), chunk=i // pp, items=list(txt))
        for ch in txt:
            if ch == "t":
                st.layers.append(layer)
                layer += 1
            elif ch == "m":
                st.mtp.append(depth)
                depth += 1
        stages.append(st)
    return Layout(stages=stages, pp=pp, vpp=vpp, text=text)
