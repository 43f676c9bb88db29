"""hybrid: sparse attention for a pretrained model's long context. Each block of consecutive
queries attends exactly to a shared set of key blocks (the first ``sinks``, the ``local`` ones
next to it, and the ``num_blocks`` that its scoring queries rate highest), computed as matrix
products over whole blocks; the keys it leaves out get no weight.

Selection (``select.py``) is the same for every form: causal, a block is scored by the queries
before it, so a query's keys depend on nothing at or after its block. The attention itself runs,
for causal self-attention on the CPU, through torch's fused CPU attention kernel per block of
queries on its gathered key blocks, forward and backward (``chunk.py``, :func:`attend_causal`);
on CUDA as one FlexAttention call (``parallel.py``; forward and backward); otherwise over
gathered key blocks, one fused attention call per chunk of query blocks (``chunk.py``; autograd,
any device and dtype). When every query block holds every key block, it is exact attention.
``naive.py`` is the dense reference they are tested against.
``decoding.py`` decodes one token at a time through a state (the keys, their block sums, the
current block's choice), each token getting its row of the causal op.

Why blocks: an earlier hybrid chose keys per query (a similarity tree over the keys, descended by
each query, plus one summary key per unchosen group). Per exact key it was 3-4x more accurate,
but its per-query work ran at a fraction of the matrix-product rate: on SmolLM2-135M at 8192
tokens it was either lossy (perplexity x1.19 at its default) or slower than exact attention
(x1.010 at 1.9x the time), where this form gives x1.011 and runs the whole model 1.46x faster
(``benchmarks/results/hybrid_mean_query/perplexity/``; the retired estimator's measurements are
in ``benchmarks/results/tree_hybrid/``). One summary key per left-out block (its mean key with
logit + log(size), its mean value, as RetroInfer estimates unselected clusters: arXiv 2505.02922)
did not lower the error on SmolLM2's attention (0.0279 against 0.0273 at 4096 tokens, 0.0573
against 0.0546 at 8192: ``benchmarks/results/hybrid_summaries.md``), so the keys left out get no
weight.

Related methods: MoBA (Lu et al. 2025, arXiv 2502.13189: blocks gated by their mean key, this
method's ``score="mean"``), XAttention (Xu et al. 2025, arXiv 2503.16428: blocks rated by
antidiagonal samples of their logits, this method's ``score="sampled"``), Quest (Tang et al.
2024, arXiv 2406.10774: pages by a per-channel bound), attention sinks (Xiao et al. 2023,
"Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453: pretrained models
park attention on the first tokens, so ``sinks`` keeps them).

Cost per query: ``(sinks + local + num_blocks) key_block`` keys (causal: plus up to
``query_block + key_block`` on the diagonal), plus ``nk`` block scores (``"mass"``) or ``M /
stride`` sampled logits (``"sampled"``: quadratic in N, the most accurate choice per key, not the
fastest: ``docs/results.md``); selection is discrete and has no gradient, the attention over the
selected keys has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...checks import check_choice, check_int, check_share
from ...registry import register_method
from .._common import keys_of_blocks
from .._masks import compute_dtype, compute_precision, each_item_without_padding
from ..softmax import sdpa
from .chunk import attend_causal, attend_gathered, causal_blocks_available
from .decoding import HybridDecodeState
from .parallel import attend_flex, flex_available
from .select import Selection, candidates, past_blocks, select_blocks
from .sharded import hybrid_context_parallel

__all__ = ["HybridDecodeState", "HybridOptions", "Selection", "hybrid_attention", "flops",
           "select_blocks", "SCORES"]

SCORES = ("mass", "mean", "mean_query", "sampled")
#: on CUDA, below this many queries the gathered form runs (FlexAttention's compile and padding to
#: a bucket cost more than the work)
FLEX_MIN_QUERIES = 2048


@dataclass
class HybridOptions:
    """``query_block``: consecutive queries that share one set of key blocks (default 512: on
    SmolLM2 at 4096 and 8192 tokens as accurate as 128 or more, and the CPU kernel runs 512-query
    units at a higher rate, ``benchmarks/results/hybrid_query_block/``); ``key_block``: keys per
    block (128: the tile of the CUDA kernels' backward; smaller blocks run there through a table
    look-up in each visited tile); ``num_blocks``: key blocks each query block selects by score
    (12: SmolLM2's perplexity x1.0065 / x1.011 of exact attention's at 4096 / 8192 tokens
    zero-shot, the whole model 1.00x / 1.46x as fast on a CPU, ``benchmarks/results/hybrid_mean_query/``);
    ``sinks``: leading key blocks always attended (1); ``local``: key blocks next to the query
    block always attended (causal: the ``local`` blocks before it; not causal: on each side; 1);
    ``score``, how a block is rated (:mod:`.select`): ``"mean_query"`` (the default: the mean
    scoring query's softmax over every candidate key, summed per block; on SmolLM2 at 8192 tokens
    error 0.030 at 16 blocks where ``"mean"`` has 0.049, for 1/512 of exact attention's products),
    ``"mean"`` (mean query times mean key, MoBA's gate), ``"mass"`` (each scoring query's softmax
    over the blocks, a block taken as copies of its mean key) or ``"sampled"`` (each scoring
    query's softmax over every ``stride``-th key, XAttention's antidiagonal sample, summed per
    block: the most accurate per key, at a cost quadratic in N); ``stride``: the ``"sampled"``
    score's (a power of two, 8; taken as at most ``key_block`` and ``query_block``);
    ``backend``: ``"auto"`` (causal self-attention on the CPU with ``key_block <= query_block``
    and ``top_p`` 1: ``"sdpa"``; on CUDA, FlexAttention for at least 2048 queries; else
    ``"gather"``, which on the CPU runs 1.6-1.7x faster than FlexAttention's CPU kernel at 4k-16k
    tokens, non-causal forward, and compiles nothing), ``"sdpa"`` (torch's fused CPU kernel per
    query block), ``"flex"`` (CUDA; on the CPU float32 inference only) or ``"gather"``;
    ``top_p``: of the chosen blocks, only the best that bring the estimated share
    of the query block's attention held by its forced and chosen blocks to ``top_p`` (Twilight's
    top-p on blocks, :mod:`.select`; default 1.0: all ``num_blocks``)."""

    query_block: int = 512
    key_block: int = 128
    num_blocks: int = 12
    sinks: int = 1
    local: int = 1
    score: str = "mean_query"
    backend: str = "auto"
    top_p: float = 1.0
    stride: int = 8

    def __post_init__(self):
        for name in ("query_block", "key_block", "stride"):
            check_int("hybrid", name, getattr(self, name), minimum=1)
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"hybrid: {name} must be a power of two, got {value}")
        for name in ("num_blocks", "sinks", "local"):
            check_int("hybrid", name, getattr(self, name), minimum=0)
        check_choice("hybrid", "score", self.score, SCORES)
        check_choice("hybrid", "backend", self.backend, ("auto", "sdpa", "flex", "gather"))
        check_share("hybrid", "top_p", self.top_p)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one non-causal forward in the gathered form: each query block against its
    gathered key blocks (unused slots of its table included), plus the block scores; exact
    attention's when every block is selected."""
    kb, qb = o["key_block"], o["query_block"]
    nk, nq = -(-M // kb), -(-N // qb)
    if o["num_blocks"] + max(o["sinks"], o["local"], 1) >= nk or _forced_and_chosen_are_all(N, M, False, o):
        return 2 * B * H * N * M * (D + Dv)  # every block: exact attention
    width = min(nk, o["num_blocks"]) + min(nk, o["sinks"] + max(1, qb // kb) + 2 * o["local"])
    scores = {"mass": nq * qb * nk * D, "mean": nq * nk * D, "mean_query": nq * nk * kb * D,
              "sampled": nq * qb * -(-M // min(o["stride"], qb, kb)) * D}[o["score"]]
    return 2 * B * H * (nq * qb * width * kb * (D + Dv) + scores)


def budget_options(o: HybridOptions, keys: int) -> dict:
    """About ``keys`` keys a query beyond its own block: ``keys / key_block`` blocks (rounded down),
    the sinks and local ones among them; ValueError below the sinks and local blocks alone."""
    least = (o.sinks + o.local) * o.key_block
    if keys < least:
        raise ValueError(f"hybrid: {keys} keys is fewer than its sink and local blocks ({least} keys); "
                         "use smaller key blocks")
    return {"num_blocks": keys // o.key_block - o.sinks - o.local}


def expected_keys(q: Tensor, k: Tensor, causal: bool, o: HybridOptions) -> Tensor:
    """``(B, H, N)`` float64: the keys each query attends on these q ``(B, H, N, D)`` and k
    ``(B, H, M, D)`` (every key real; the registry's ``expected_keys``): its selected blocks' keys
    (causal: those at or before it). With ``top_p`` < 1 the count depends on the inputs."""
    B, H, N, _ = q.shape
    M = k.shape[2]
    QB, KB = o.query_block, o.key_block
    nk = -(-M // KB)
    if _selects_all(M, causal, o):
        hit = torch.ones(B, H, -(-N // QB), nk, dtype=torch.bool, device=q.device)
    else:
        sq, sk = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (q, k))
        sel = select_blocks(sq, sk, causal, q.shape[-1] ** -0.5, query_block=QB, key_block=KB, num_blocks=o.num_blocks,
                            sinks=o.sinks, local=o.local, score=o.score, top_p=o.top_p, stride=o.stride)
        hit = torch.zeros(B, H, sel.index.shape[2], nk + 1, dtype=torch.bool, device=q.device)
        hit = hit.scatter_(-1, torch.where(sel.valid, sel.index, nk), True)[..., :nk]
    return keys_of_blocks(hit, N, M, QB, KB, causal)


@register_method(
    "hybrid",
    options=HybridOptions,
    summary="exact attention over the sink, local and top-scoring key blocks of each query block",
    causal=True,
    cross_attention=True,
    complexity="linear",
    flops=flops,
    test_options={"query_block": 4, "key_block": 2, "num_blocks": 2, "sinks": 1, "local": 1},
    fullgraph_with_padding=False,  # padding is removed first: shapes from the mask
    decode_state=HybridDecodeState,
    budget_options=budget_options,
    expected_keys=expected_keys,
    context_parallel=hybrid_context_parallel,
)
def hybrid_attention(q, k, v, key_padding_mask, causal, scale, *, options: HybridOptions):
    """hybrid attention (see the module docstring).

    Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    Causal: query ``i`` sees the keys at positions ``<= i``. Padding is removed first: blocks are
    counted over each item's real keys (and, in self-attention, its real queries), so a padded batch
    computes what each item computes alone, and padded content never reaches an output; a query at a
    padded position takes the output of the last real query before it (causal: zeros when there is
    none; not causal: the first real query's), an item without real keys outputs zeros (equal query
    and key lengths are read as self-attention:
    :func:`~subquad.ops._masks.each_item_without_padding`). When the selection would take every key
    block, this is exact attention (SDPA, whose outputs at padded query positions are its own).
    Computes in float32 (float64 stays float64) except on CUDA, where FlexAttention takes
    half-precision inputs as they are (accumulating in float32); returns the dtype of q."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    half_on_gpu = q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
    dtype = q.dtype if half_on_gpu else compute_dtype(q.dtype)
    if _selects_all(k.shape[2], causal, options):  # exact attention, masks as given
        return sdpa(q, k, v, key_padding_mask, causal, scale)
    with compute_precision(q):
        qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
        if key_padding_mask is None or not bool(key_padding_mask.any()):
            out = _attention(qc, kc, vc, causal, scale, options)
        else:
            out = each_item_without_padding(lambda q, k, v: _attention(q, k, v, causal, scale, options), qc, kc, vc,
                                            key_padding_mask, causal)
    return out.to(q.dtype)


def _selects_all(m: int, causal: bool, o: HybridOptions) -> bool:
    """Whether every query block would attend to every key block it may see (``m`` keys or fewer;
    never with ``top_p`` < 1, which may prune even then)."""
    return o.top_p >= 1 and o.num_blocks + max(o.sinks, o.local, 0 if causal else 1) >= -(-m // o.key_block)


def _forced_and_chosen_are_all(n: int, m: int, causal: bool, o: dict) -> bool:
    """Not causal: whether every query block would hold every key block, its forced ones (sinks,
    its own, local) and ``num_blocks`` chosen among the rest (as at 2048 tokens at the defaults);
    the sizes decide it, not the scores. ``o``: the options as a dict."""
    if causal or o["top_p"] < 1 or torch.compiler.is_compiling():
        return False
    _, _, candidate, forced = candidates(n, m, False, query_block=o["query_block"], key_block=o["key_block"],
                                         sinks=o["sinks"], local=o["local"], device=torch.device("cpu"))
    return int((candidate & ~forced).sum(-1).max()) <= o["num_blocks"]


def _attention(q, k, v, causal, scale, o):
    if _selects_all(k.shape[2], causal, o) or _forced_and_chosen_are_all(q.shape[2], k.shape[2], causal, vars(o)):
        return sdpa(q, k, v, None, causal, scale)
    with torch.no_grad():  # selection is discrete: no gradient
        sq, sk = (q.float(), k.float()) if q.dtype in (torch.float16, torch.bfloat16) else (q, k)
        sel = select_blocks(sq.detach(), sk.detach(), causal, scale, query_block=o.query_block, key_block=o.key_block,
                            num_blocks=o.num_blocks, sinks=o.sinks, local=o.local, score=o.score, top_p=o.top_p,
                            stride=o.stride)
    # the causal kernel takes every row's full count of past blocks (top_p prunes some)
    if o.backend in ("auto", "sdpa") and causal and o.top_p >= 1 and causal_blocks_available(q, k, sel):
        return attend_causal(q, k, v, sel, past_blocks(o.num_blocks, o.sinks, o.local), scale)
    if o.backend == "sdpa":
        raise ValueError("hybrid: backend='sdpa' runs causal self-attention on the CPU with key_block <= "
                         "query_block and top_p=1; use backend='auto'")
    use_flex = o.backend == "flex" or (o.backend == "auto" and q.device.type == "cuda"
                                       and q.shape[2] >= FLEX_MIN_QUERIES)
    if use_flex:
        if not flex_available(q):
            raise ValueError("hybrid: backend='flex' needs CUDA, or float32 CPU tensors without autograd "
                             "(torch's CPU FlexAttention has no backward); use backend='gather'")
        return attend_flex(q, k, v, sel, causal, scale)
    return attend_gathered(q, k, v, sel, causal, scale)
