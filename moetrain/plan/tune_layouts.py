"""Pipeline layouts the tuner tries: balanced by cost, even layer counts, and the MTP depths on a stage of their own.

A layout splits the model's items in order, the embedding E, the decoder layers t, the MTP depths m and the loss L,
into n = pp x vpp stages (``config.pipeline_layout``'s grammar). The stages of a pipeline run at the pace of the
slowest one, so the first layout minimises the largest stage's work (f + b + w per micro-batch, no recompute): a
contiguous min-max partition, exact (the smallest threshold among the sums of contiguous runs for which a greedy
split needs at most n stages), each stage then closing near an even share of the rest under that threshold. That
puts fewer layers beside the embedding and the loss, and more cheap dense layers together ("embedding/loss-aware").
The second gives every stage the same number of layers, the remainder to the middle stages (so the first and the
last, which also hold E and L, get fewer). The third splits like the first with the MTP depths and the loss as two
items, so that the depths may end the penultimate stage.

Every layout returned parses back to the same stages (``config.pipeline_layout.expand``). Pure Python.
"""

from __future__ import annotations

from moetrain.config.pipeline_layout import expand


def _greedy(costs: list[float], n: int, limit: float) -> list[int] | None:
    """Stage sizes of a left-to-right split with every stage's sum <= limit, exactly n non-empty stages (a stage
    closes early when the items left are only enough for one per remaining stage); None if impossible."""
    sizes, cur, count = [], 0.0, 0
    for i, c in enumerate(costs):
        left_items, left_stages = len(costs) - i, n - len(sizes)
        if count and (cur + c > limit or left_items < left_stages):
            sizes.append(count)
            cur, count = 0.0, 0
        if c > limit:
            return None
        cur, count = cur + c, count + 1
    sizes.append(count)
    return sizes if len(sizes) == n else None


def _spread(costs: list[float], n: int, limit: float) -> list[int] | None:
    """Stage sizes with every sum <= limit, each stage closing near an even share of what is left (so that the
    stages under the limit are not all pushed to the end); None if that does not work out."""
    sizes, i, left = [], 0, sum(costs)
    for k in range(n):
        stages_left = n - k
        target, cur, count = left / stages_left, 0.0, 0
        while i < len(costs) and len(costs) - i > stages_left - 1:
            c = costs[i]
            if count and stages_left > 1 and (cur + c > limit or cur + c / 2 > target):
                break
            cur, count, i = cur + c, count + 1, i + 1
        if count == 0 or cur > limit:
            return None
        sizes.append(count)
        left -= cur
    return sizes if i == len(costs) else None


def min_max_split(costs: list[float], n: int) -> list[int]:
    """Sizes of n contiguous non-empty stages whose largest sum is the smallest possible, spread evenly where the
    limit leaves a choice; len(costs) >= n."""
    if not 1 <= n <= len(costs):
        raise ValueError(f"cannot split {len(costs)} items into {n} stages")
    limits = set()
    for i in range(len(costs)):  # every contiguous run's sum, added in the order the splits add them
        run = 0.0
        for c in costs[i:]:
            run += c
            limits.add(run)
    limits = sorted(limits)
    lo, hi = 0, len(limits) - 1
    while lo < hi:  # the smallest limit a split meets (greedy success is monotone in the limit)
        mid = (lo + hi) // 2
        if _greedy(costs, n, limits[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return _spread(costs, n, limits[lo]) or _greedy(costs, n, limits[lo])


def _text(stages: list[str]) -> str:
    """The layout string: each stage's layers as t*k, runs of equal stages as (stage|)*r."""
    def one(s: str) -> str:
        k = s.count("t")
        return s.replace("t" * k, f"t*{k}" if k > 2 else "t" * k) if k else s

    parts, i = [], 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) and stages[j + 1] == stages[i]:
            j += 1
        run = j - i + 1
        last = j == len(stages) - 1
        if run >= 3 and not last:
            parts.append(f"({one(stages[i])}|)*{run}")
        else:
            parts.append("|".join([one(stages[i])] * run) + ("" if last else "|"))
        i = j + 1
    text = "".join(parts)
    assert expand(text) == stages, (text, stages)
    return text


def _stages(labels: list[str], sizes: list[int]) -> list[str]:
    out, i = [], 0
    for k in sizes:
        out.append("".join(labels[i:i + k]))
        i += k
    return out


def balanced(item_costs: dict[str, float], L: int, D: int, n: int, mtp_apart: bool = False) -> str | None:
    """The min-max layout over E, t x L, then the MTP depths and L (one item, or two with ``mtp_apart``).
    ``item_costs`` has E, t{i} for each layer, M (all MTP depths, alone), L (alone) and ML (together)."""
    labels = ["E"] + ["t"] * L
    costs = [item_costs["E"]] + [item_costs[f"t{i}"] for i in range(L)]
    if D and mtp_apart:
        labels += ["m" * D, "L"]
        costs += [item_costs["M"], item_costs["L"]]
    else:
        labels.append("m" * D + "L")
        costs.append(item_costs["ML"] if D else item_costs["L"])
    if n > len(costs):
        return None
    return _text(_stages(labels, min_max_split(costs, n)))


def even(L: int, D: int, n: int) -> str | None:
    """Every stage the same number of layers; the remainder one each to the middle stages first, then to the
    first and the last. None when there are fewer layers than stages."""
    if n > L:
        return None
    counts = [L // n] * n
    order = list(range(1, n - 1)) + [0, n - 1] if n > 2 else list(range(n))
    for i in order[:L % n]:
        counts[i] += 1
    stages = ["t" * k for k in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * D + "L"
    return _text(stages)


def layouts(item_costs: dict[str, float], L: int, D: int, n: int) -> list[str]:
    """The distinct layouts of n stages: balanced, even, MTP apart (in that order)."""
    out = []
    for text in (balanced(item_costs, L, D, n), even(L, D, n),
                 balanced(item_costs, L, D, n, mtp_apart=True) if D else None):
        if text is not None and text not in out:
            out.append(text)
    return out
