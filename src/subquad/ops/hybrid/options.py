"""hybrid's options, the rule that splits its budget, and the resolved plan of one call."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...checks import check_choice, check_int

__all__ = ["HybridOptions", "HybridPlan", "plan", "num_selected", "candidate_count", "QUERY_BLOCK", "CHUNK_BYTES",
           "GROUPINGS", "SCORINGS"]

GROUPINGS = ("tree", "contiguous")
SCORINGS = ("mass", "mean")

#: queries (consecutive) that share one descent of the key tree, and so one set of candidate leaves
QUERY_BLOCK = 64
# gathered window and candidate keys and values of one (batch, head) per run of query blocks: small
# enough that a run's gathered rows, logits and weights stay in a 2-core CPU's cache (one head,
# N = 16384, one thread: 118 ms per call at 4 MiB, 137 ms at 16 MiB, 142 ms at 1 MiB)
CHUNK_BYTES = 1 << 22


@dataclass
class HybridOptions:
    """``budget``: keys attended exactly + summaries per query (default 64); ``window``,
    ``block_size`` (keys per leaf), ``num_selected`` (leaves attended exactly per query),
    ``num_summaries`` (coarse groups, a power of two): the parts, derived from the budget when
    None; ``grouping``: ``"tree"`` (keys grouped by similarity; causal: within sealed chunks) or
    ``"contiguous"`` (by position); ``scoring``: ``"mass"`` or ``"mean"``;
    ``candidates``: leaves each block of queries scores exactly (all of them when there are at
    most this many), found by a beam descent of the key tree keeping ``beam`` nodes per level
    (None: the power of two at or above ``8 num_selected``, at least 128, and a quarter of it;
    fewer trade error for speed: at 16384 keys 64 and 32 candidates ran 1.2x and 1.45x faster than
    128, while SmolLM2's mean error at 8192 tokens went 0.169 -> 0.182 -> 0.200,
    ``benchmarks/results/hybrid_candidates.md``);
    ``chunk_size``: keys per sealed chunk in causal mode (a power of two); ``sinks``: leading
    leaves (the first ``sinks * block_size`` keys, where pretrained models park attention) that
    are always among the candidates; ``tree_iterations``: power-iteration steps per node;
    ``query_beam``: nodes per level that each query's own descent of the tree keeps (from its
    block's start; the leaves it ends on join that query's candidates), 0: none, None: 4 when
    causal, 0 otherwise. A causal block's shared descent runs on the queries before the block
    (nothing later may steer an earlier query's choice), so it cannot find a key that only a
    query's own content points to, as in the copy-like heads of LLMs (SmolLM2-135M at 8192
    tokens, mean error of 10 layers: 0.177 without, 0.169 with 4, 0.159 with 32, 0.155 with
    every leaf scored; layer 18: 0.209 / 0.160 / 0.085 / 0.057). A non-causal block descends
    with its own queries."""

    budget: int = 64
    window: int | None = None
    block_size: int = 4
    num_selected: int | None = None
    num_summaries: int | None = None
    grouping: str = "tree"
    scoring: str = "mass"
    candidates: int | None = None
    beam: int | None = None
    chunk_size: int = 128
    sinks: int = 1
    tree_iterations: int = 4
    query_beam: int | None = None

    def __post_init__(self):
        for name in ("budget", "block_size", "chunk_size", "tree_iterations"):
            check_int("hybrid", name, getattr(self, name), minimum=1)
        for name in ("candidates", "beam"):
            if getattr(self, name) is not None:
                check_int("hybrid", name, getattr(self, name), minimum=1)
        for name in ("window", "num_selected", "sinks", "query_beam"):
            if getattr(self, name) is not None:
                check_int("hybrid", name, getattr(self, name), minimum=0)
        if self.num_summaries is not None:
            check_int("hybrid", "num_summaries", self.num_summaries, minimum=1)
        check_choice("hybrid", "grouping", self.grouping, GROUPINGS)
        check_choice("hybrid", "scoring", self.scoring, SCORINGS)
        for name in ("block_size", "candidates", "beam", "chunk_size"):
            value = getattr(self, name)
            if value is not None and value & (value - 1):
                raise ValueError(f"hybrid: {name} must be a power of two, got {value}")
        if self.num_summaries is not None and self.num_summaries & (self.num_summaries - 1):
            raise ValueError(f"hybrid: num_summaries must be a power of two, got {self.num_summaries}")
        if self.beam is not None and self.candidates is not None and self.beam > self.candidates:
            raise ValueError(f"hybrid: beam ({self.beam}) must not exceed candidates ({self.candidates})")


@dataclass(frozen=True)
class HybridPlan:
    """The resolved parts for one call (``n_keys`` real keys): every field set.

    ``depth``: levels of the key tree (``2**depth`` leaves of ``block_size`` slots);
    ``chunk_level``: the first level whose nodes are split by similarity (levels above it split
    by position: every level for ``contiguous`` grouping, the levels above the sealed chunks when
    causal, none otherwise); ``final_level``: the level of the nodes the descent ends on (their
    leaves are the candidates); ``start_level``: where it starts (every node of that level);
    ``query_beam``: the beam of each query's own descent (0: none)."""

    window: int
    block_size: int
    num_selected: int
    num_summaries: int
    scoring: str
    causal: bool
    depth: int
    chunk_level: int
    start_level: int
    final_level: int
    beam: int
    chunk_size: int
    sinks: int
    tree_iterations: int
    query_beam: int = 0

    @property
    def slots(self) -> int:
        return self.block_size << self.depth

    @property
    def one_stage(self) -> bool:
        """Every leaf is a candidate of every block: no descent."""
        return self.final_level == 0


def num_selected(o: HybridOptions) -> int:
    """Leaves attended exactly per query: ``o.num_selected``, or what the budget leaves after the
    window and the summaries."""
    if o.num_selected is not None:
        return o.num_selected
    summaries = o.num_summaries or 1 << max(0, int(math.log2(max(1, o.budget // 8))))
    window = o.budget // 8 if o.window is None else o.window
    return max(0, (o.budget - window - summaries) // o.block_size)


def candidate_count(o: HybridOptions, selected: int | None = None) -> int:
    """Leaves a query block scores exactly: ``o.candidates``, or the power of two at or above
    8 per selected leaf, at least 128."""
    selected = num_selected(o) if selected is None else selected
    return o.candidates or max(128, 1 << math.ceil(math.log2(max(1, 8 * selected))))


def plan(o: HybridOptions, n_keys: int, causal: bool) -> HybridPlan:
    """Split ``o.budget`` into window, selected leaves and summaries (``num_summaries`` = the
    largest power of two <= budget / 8, ``window`` = budget // 8, ``num_selected`` = what is left
    in leaves of ``block_size``), size the candidates (8 per selected leaf, at least 128) and
    lay out the key tree for ``n_keys`` real keys."""
    summaries = o.num_summaries
    if summaries is None:
        summaries = 1 << max(0, int(math.log2(max(1, o.budget // 8))))
    window = o.budget // 8 if o.window is None else o.window
    selected = num_selected(o)
    bs = o.block_size
    depth = max(math.ceil(math.log2(max(1, -(-n_keys // bs)))), int(math.log2(summaries)))
    if o.grouping == "contiguous":
        chunk_level = depth
    elif causal:
        chunk_level = max(0, depth - int(math.log2(max(1, o.chunk_size // bs))))
    else:
        chunk_level = 0
    candidates = candidate_count(o, selected)
    beam = o.beam or max(1, candidates // 4)
    if beam > candidates:
        raise ValueError(f"hybrid: beam ({beam}) must not exceed candidates ({candidates})")
    if (1 << depth) <= candidates:
        final = start = 0
    else:
        final = depth - int(math.log2(candidates // beam))  # final nodes hold candidates / beam leaves
        start = min(int(math.log2(beam)), final)
    query_beam = (4 if causal else 0) if o.query_beam is None else o.query_beam
    if final <= start:  # no descent: every block's candidates are the whole start level already
        query_beam = 0
    return HybridPlan(min(window, max(n_keys, 1)), bs, selected, summaries, o.scoring, causal, depth, chunk_level,
                      start, final, beam, o.chunk_size, o.sinks, o.tree_iterations, query_beam)
