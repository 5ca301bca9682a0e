"""The ``parallel.pipeline_layout`` grammar and the rules a layout must satisfy.

Grammar (whitespace and commas are ignored):

    layout  := stage ('|' stage)*          stages in pipeline order
    stage   := item*                       may be empty
    item    := atom ('*' N)?               N >= 1 repeats the atom
    atom    := 'E' | 't' | 'm' | 'L' | '(' layout ')'

``E`` is the embedding, ``t`` one decoder layer (in order: the i-th ``t`` is layer i), ``m``
one MTP depth, ``L`` the final norm + output head + loss. A group may contain ``|``, so
``E|(t*2|)*3t*2L`` is ``E|t*2|t*2|t*2|t*2L``.

Rules (``layout_stages``): exactly parallel.pp x parallel.vpp stages; exactly one E and one L,
E in the first stage and before every t and m, L in the last stage and after them; as many
``t`` as model.num_layers and ``m`` as model.mtp_num_layers, every ``m`` after the last ``t``.
With pp = 1 a layout is one stage holding the whole model.

Config data: imports nothing of ours but errors, so that ``Config.check`` refuses a bad layout
at load time and ``moetrain.plan.layout`` places the stages of the same parse.
"""

from __future__ import annotations

from moetrain.errors import ConfigError

KEY = "parallel.pipeline_layout"
LETTERS = "EtmL"


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
            if self.s[self.i] == "|":
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


def _check_stage_count(text: str, n: int, pp: int, vpp: int) -> None:
    want = pp * vpp
    if n == want:
        return
    if want == 1:
        hint = f"set parallel.pp = {n} or write one stage (no '|')"
    elif n % pp == 0:
        hint = f"set parallel.vpp = {n // pp} or write {want} stages"
    else:
        hint = f"write {want} stages"
    raise ConfigError(f"{KEY} = {text!r} has {n} stages, but parallel.pp ({pp}) x parallel.vpp ({vpp}) = {want}; "
                      f"{hint}")


def _check_contents(text: str, stages: list[str], num_layers: int, mtp_num_layers: int) -> None:
    counts = {ch: sum(s.count(ch) for s in stages) for ch in LETTERS}
    if counts["E"] != 1 or counts["L"] != 1:
        raise ConfigError(f"{KEY} = {text!r} must contain exactly one E and one L (found {counts['E']} E, "
                          f"{counts['L']} L)")
    if "E" not in stages[0]:
        raise ConfigError(f"{KEY} = {text!r}: E (embedding) must be in the first stage")
    if "L" not in stages[-1]:
        raise ConfigError(f"{KEY} = {text!r}: L (loss) must be in the last stage")
    if counts["t"] != num_layers:
        raise ConfigError(f"{KEY} = {text!r} places {counts['t']} decoder layers (t) but model.num_layers = "
                          f"{num_layers}")
    if counts["m"] != mtp_num_layers:
        raise ConfigError(f"{KEY} = {text!r} places {counts['m']} MTP layers (m) but model.mtp_num_layers = "
                          f"{mtp_num_layers}")
    flat = "".join(stages)
    if "m" in flat and "t" in flat and flat.index("m") < flat.rindex("t"):
        raise ConfigError(f"{KEY} = {text!r}: every MTP layer (m) must come after the last decoder layer (t)")
    if flat.rindex("L") < max(flat.rfind("t"), flat.rfind("m")):
        raise ConfigError(f"{KEY} = {text!r}: L must come after every t and m")
    if flat.index("E") > min([flat.find(c) for c in "tm" if c in flat] or [len(flat)]):
        raise ConfigError(f"{KEY} = {text!r}: E must come before every t and m")


def layout_stages(text: str, *, num_layers: int, mtp_num_layers: int, pp: int, vpp: int) -> list[str]:
    """The stages of layout ``text``, checked against the model and the pipeline (see the module doc).

    Raises ConfigError naming parallel.pipeline_layout and what would be valid.
    """
    stages = expand(text)
    _check_stage_count(text, len(stages), pp, vpp)
    _check_contents(text, stages, num_layers, mtp_num_layers)
    return stages


# ---- schedules and placement -------------------------------------------------------------------------------------

SCHEDULES = ("1f1b", "interleaved", "zero_bubble", "dualpipev")
V_SCHEDULES = ("zero_bubble", "dualpipev")  # two stages per rank, placed in a V


def stage_rank(index: int, pp: int, schedule: str) -> int:
    """The pipeline rank of stage ``index``: looped (stage i on rank i mod pp) for 1f1b and interleaved; V for
    zero_bubble and dualpipev (stage i on rank i for i < pp, on rank 2 pp - 1 - i after), as torch places them."""
    if schedule in V_SCHEDULES:
        return index if index < pp else 2 * pp - 1 - index
    return index % pp


def check_schedule(schedule: str, pp: int, vpp: int, micro_batches: int) -> None:
    """ConfigError for a schedule torch.distributed.pipelining cannot run with these degrees and micro-batches per
    step (``micro_batches`` = train.global_batch_size / (train.micro_batch_size x parallel.dp))."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if pp == 1:
        return
    mb = f"micro-batches per step (train.global_batch_size / (train.micro_batch_size x parallel.dp)) = {micro_batches}"
    if schedule == "1f1b" and vpp > 1:
        raise ConfigError(f"parallel.pp_schedule = 1f1b runs one stage per rank, but parallel.vpp = {vpp}; set "
                          "parallel.pp_schedule=interleaved for virtual stages, or parallel.vpp=1")
    if schedule == "interleaved" and vpp < 2:
        raise ConfigError("parallel.pp_schedule = interleaved needs parallel.vpp >= 2 (virtual stages per rank); "
                          "set parallel.vpp=2, or parallel.pp_schedule=1f1b")
    if schedule in V_SCHEDULES and vpp != 2:
        raise ConfigError(f"parallel.pp_schedule = {schedule} places exactly two stages per rank in a V; set "
                          f"parallel.vpp=2 (it is {vpp})")
    if schedule == "1f1b" and micro_batches < pp:
        raise ConfigError(f"parallel.pp_schedule = 1f1b needs at least parallel.pp = {pp} micro-batches per step; "
                          f"{mb}: raise train.global_batch_size or lower train.micro_batch_size")
    if schedule == "interleaved":
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            raise ConfigError(f"parallel.pp_schedule = interleaved runs the micro-batches in rounds of parallel.pp "
                              f"= {pp}; {mb}, not a multiple of its {rounds} rounds: use a multiple of {pp}")
    if schedule in V_SCHEDULES and micro_batches < 2 * pp:
        raise ConfigError(f"parallel.pp_schedule = {schedule} needs at least 2 x parallel.pp = {2 * pp} "
                          f"micro-batches per step; {mb}: raise train.global_batch_size or lower "
                          "train.micro_batch_size")


def default_layout(num_layers: int, mtp_num_layers: int, n_stages: int) -> str:
    """The layout without parallel.pipeline_layout: the decoder layers split evenly over ``n_stages`` stages, E on
    the first, the MTP depths and L on the last. ConfigError where the layers do not divide evenly."""
    per = num_layers // n_stages
    if per * n_stages != num_layers:
        raise ConfigError(f"model.num_layers = {num_layers} is not divisible by parallel.pp x parallel.vpp = "
                          f"{n_stages}; set {KEY} for uneven stages")
    stages = ["t" * per for _ in range(n_stages)]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp_num_layers + "L"
    return "|".join(stages)
