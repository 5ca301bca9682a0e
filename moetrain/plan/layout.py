"""Pipeline layouts: the ``parallel.pipeline_layout`` grammar and stage placement.

Grammar (whitespace and commas are ignored):

    layout  := stage ('|' stage)*          stages in pipeline order
    stage   := item*                       may be empty
    item    := atom ('*' N)?               N >= 1 repeats the atom
    atom    := 'E' | 't' | 'm' | 'L' | '(' layout ')'

``E`` is the embedding, ``t`` one decoder layer (in order: the i-th ``t`` is layer i), ``m``
one MTP depth, ``L`` the final norm + output head + loss. A group may contain ``|``, so
``E|(t*2|)*3t*2L`` is ``E|t*2|t*2|t*2|t*2L``. Rules checked: exactly one E and one L; E in
the first stage, L in the last; as many ``t`` as model.num_layers and ``m`` as
model.mtp_num_layers; every ``m`` after every ``t`` and not after L. The number of stages must
be a multiple of parallel.pp; VPP = stages / pp (parallel.vpp must be 1 or equal to it) and
stage i runs on pipeline rank i mod pp as its virtual chunk i // pp.

Without a layout: pp * vpp stages with the decoder layers split evenly (Config.check demands
divisibility), E on the first stage, the MTP depths and L on the last.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrain.config.schema import Config
from moetrain.errors import ConfigError

KEY = "parallel.pipeline_layout"
LETTERS = "EtmL"


@dataclass
class Stage:
    index: int  # position in the pipeline, 0-based
    rank: int  # pipeline rank = index % pp
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


# ---- parsing ------------------------------------------------------------------------------------

class _Parser:
    def __init__(self, text: str):
        self.src = text
        self.s = "".join(ch for ch in text if not ch.isspace() and ch != ",")
        self.i = 0

    def error(self, what: str) -> ConfigError:
        return ConfigError(f"{KEY} = {self.src!r}: {what} (grammar: stages separated by '|' of E, t, m, L; "
                           f"x*n repeats x, (...)*n repeats a group; e.g. 'Et*3|t*4|t*4|t*3mL')")

    def parse(self) -> str:
        out = self.sequence()
        if self.i != len(self.s):
            raise self.error(f"unexpected {self.s[self.i]!r} at position {self.i}")
        return out

    def sequence(self) -> str:
        out = []
        while self.i < len(self.s) and self.s[self.i] != ")":
            ch = self.s[self.i]
            if ch == "|":
                out.append("|")
                self.i += 1
                continue
            out.append(self.item())
        return "".join(out)

    def item(self) -> str:
        ch = self.s[self.i]
        if ch in LETTERS:
            self.i += 1
            atom = ch
        elif ch == "(":
            self.i += 1
            atom = self.sequence()
            if self.i >= len(self.s) or self.s[self.i] != ")":
                raise self.error("unclosed '('")
            self.i += 1
        elif ch == "*":
            raise self.error(f"'*' at position {self.i} has nothing to repeat")
        else:
            raise self.error(f"unknown symbol {ch!r} (valid: E, t, m, L, |, (, ), *n)")
        if self.i < len(self.s) and self.s[self.i] == "*":
            self.i += 1
            start = self.i
            while self.i < len(self.s) and self.s[self.i].isdigit():
                self.i += 1
            if start == self.i:
                raise self.error(f"'*' at position {start - 1} must be followed by a count")
            n = int(self.s[start:self.i])
            if n < 1:
                raise self.error(f"repeat count {n} must be >= 1")
            atom = atom * n
        return atom


def expand(text: str) -> list[str]:
    """The stages of a layout string, each as a string of letters (groups and repeats expanded)."""
    return _Parser(text).parse().split("|")


def parse_layout(cfg: Config) -> Layout:
    """The stage layout of ``cfg`` (explicit ``parallel.pipeline_layout`` or the default)."""
    p, m = cfg.parallel, cfg.model
    if p.pipeline_layout is None:
        return default_layout(cfg)
    text = p.pipeline_layout
    stages_txt = expand(text)
    n = len(stages_txt)
    if n % p.pp:
        raise ConfigError(f"{KEY} = {text!r} has {n} stages, not a multiple of parallel.pp = {p.pp}")
    vpp = n // p.pp
    if p.vpp not in (1, vpp):
        raise ConfigError(f"{KEY} = {text!r} has {n} stages = {vpp} per pipeline rank, but parallel.vpp = {p.vpp}; "
                          f"set parallel.vpp to {vpp} (or 1)")
    counts = {ch: sum(s.count(ch) for s in stages_txt) for ch in LETTERS}
    if counts["E"] != 1 or counts["L"] != 1:
        raise ConfigError(f"{KEY} = {text!r} must contain exactly one E and one L (found {counts['E']} E, "
                          f"{counts['L']} L)")
    if "E" not in stages_txt[0]:
        raise ConfigError(f"{KEY} = {text!r}: E (embedding) must be in the first stage")
    if "L" not in stages_txt[-1]:
        raise ConfigError(f"{KEY} = {text!r}: L (loss) must be in the last stage")
    if counts["t"] != m.num_layers:
        raise ConfigError(f"{KEY} = {text!r} places {counts['t']} decoder layers (t) but model.num_layers = "
                          f"{m.num_layers}")
    if counts["m"] != m.mtp_num_layers:
        raise ConfigError(f"{KEY} = {text!r} places {counts['m']} MTP layers (m) but model.mtp_num_layers = "
                          f"{m.mtp_num_layers}")
    flat = "".join(stages_txt)
    if "m" in flat and "t" in flat and flat.index("m") < flat.rindex("t"):
        raise ConfigError(f"{KEY} = {text!r}: every MTP layer (m) must come after the last decoder layer (t)")
    if flat.rindex("L") < max(flat.rfind("t"), flat.rfind("m")):
        raise ConfigError(f"{KEY} = {text!r}: L must come after every t and m")
    if flat.index("E") > min([flat.find(c) for c in "tm" if c in flat] or [len(flat)]):
        raise ConfigError(f"{KEY} = {text!r}: E must come before every t and m")
    return _build(stages_txt, p.pp, vpp, text)


def default_layout(cfg: Config) -> Layout:
    p, m = cfg.parallel, cfg.model
    n = p.pp * p.vpp
    per = m.num_layers // n
    if per * n != m.num_layers:
        raise ConfigError(f"model.num_layers = {m.num_layers} is not divisible by parallel.pp ({p.pp}) x "
                          f"parallel.vpp ({p.vpp}); set {KEY} for uneven stages")
    stages = ["t" * per for _ in range(n)]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * m.mtp_num_layers + "L"
    return _build(stages, p.pp, p.vpp, "|".join(stages))


def _build(stages_txt: list[str], pp: int, vpp: int, text: str) -> Layout:
    stages, layer, depth = [], 0, 0
    for i, txt in enumerate(stages_txt):
        st = Stage(index=i, rank=i % pp, chunk=i // pp, items=list(txt))
        for ch in txt:
            if ch == "t":
                st.layers.append(layer)
                layer += 1
            elif ch == "m":
                st.mtp.append(depth)
                depth += 1
        stages.append(st)
    return Layout(stages=stages, pp=pp, vpp=vpp, text=text)
