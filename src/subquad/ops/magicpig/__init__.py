"""MagicPIG (Chen et al. 2024, "MagicPIG: LSH Sampling for Efficient LLM Generation", arXiv
2410.16179, Section 4): attention estimated by importance sampling, the sample drawn by
locality-sensitive hashing. Training-free.

Static keys are attended exactly: the first ``sinks`` real keys (attention sinks) and the ``local``
real keys nearest the query (causal: the ``local`` most recent ones, the query's own key included;
not causal: those fewer than ``local`` real keys away on either side). Every other visible key is a
candidate: ``num_tables`` (L) SimHash tables of ``num_bits`` (K) Gaussian hyperplanes give a query
and a key a K-bit code per table, and the key is sampled when its code equals the query's in at
least ``min_matches`` tables (MagicPIG's rule: 2). At an angle ``theta`` between query and key one
table collides with probability ``P = (1 - theta/pi)^K``, so the key is sampled with probability
``u = P[Binomial(L, P) >= min_matches]``. The output is the self-normalised importance-sampling
estimate

    (sum_static e^{l_i} v_i + sum_sampled e^{l_i} / u_i v_i) / (the same sums without v_i),

one softmax over the kept keys with the sampled keys' logits lowered by ``log u`` (as MagicPIG's
released code computes it, there with ``log(u + 1e-4)``; here ``u`` is summed without cancellation
where it is small and floored at the dtype's smallest normal number). A query whose sample is empty
(possible only without static keys) outputs zeros.

Choices (the defaults and their sources: :class:`MagicpigOptions`): static keys are counted over
each item's real keys, so a padded item keeps what it keeps unpadded; query ``i`` stands at key
position ``i`` also when N != M (as ``hybrid`` places its local blocks; the extra keys of
``add_bias_kv`` come last); which keys are static leaves both sums unbiased, it changes only their
variance. One draw of hyperplanes serves every batch item and head (:func:`draw_hyperplanes`; pass
them as ``hyperplanes`` to keep one draw; a retrofit and ``subquad.MultiheadAttention``
draw them once through the registry's ``fixed_draw`` and keep them as a buffer).
MagicPIG's released code also subtracts the mean of the hashed keys before hashing; this form does
not (in a causal prefill that mean would differ per query).

Gradients: the hashing and the sampling have none, and ``u`` is held constant under autograd
(detached): the gradient is that of the softmax over the kept keys with fixed ``log u`` offsets,
the importance-sampling estimate of exact attention's gradient, not the derivative of ``u`` in
the angle. So finite differences in q and k agree with it only where ``u`` does not move
(``min_matches=0``, or every kept key static).

This form computes each query's full row of logits (exact attention's cost, plus the hashing) to
measure what the estimator gives, not to be fast; ``subquad compare`` runs it when named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...checks import check_int
from ...registry import register_method
from .._common import check_generator, check_tensor_option
from .._masks import compute_dtype, compute_precision, drop_padded, masked_fill_value
from ..topk import visible_logits

__all__ = ["MagicpigOptions", "collision_log_probability", "draw_hyperplanes", "expected_keys",
           "magicpig_attention", "simhash_codes", "static_keys"]

#: bytes of (queries x keys) work tensors formed at once (queries are taken in chunks)
_CHUNK_BYTES = 1 << 26
#: the most hyperplanes a table may have: a table's code is packed into one int64
MAX_BITS = 62
#: below this, ``u`` is summed from its tail terms instead of taken as one minus its head terms
_TAIL_BELOW = 1e-2
#: tail terms summed from ``min_matches`` on (see collision_log_probability for the accuracy)
_TAIL_TERMS = 16


@dataclass
class MagicpigOptions:
    """``num_bits`` (K, default 8) hyperplanes per table and ``num_tables`` (L, default 75) tables.
    MagicPIG's released code defaults to K = 10, L = 150 for Llama-3.1-8B (head dimension 128) and
    its README reports K10L150, K10L170 and K11L300 at 2-2.5 % of attention's computation; the
    choice is the paper's appendix "Selection of hyper-parameter (K, L)". The collision
    probability depends on the angle alone; the head dimension sets how far unrelated keys stray
    from a right angle (about 1/sqrt(D) radians, 7 degrees at D = 64). With (8, 75) a key is
    sampled with probability 3.5 % at 90 degrees, 27 % at 75, 80 % at 60 and 99.7 % at 45 (with
    (10, 150): 1.0 %, 15 %, 74 %, 99.8 %): about 3.6x as many unrelated keys as (10, 150) and half
    the hashing, a sample of 36-575 keys at the 1k-16k keys this library measures (topk's default
    budget is 256), where (10, 150) would sample 10-160. ``min_matches``: tables whose codes must
    agree (default 2, MagicPIG's). ``sinks``: first real keys always attended (default 4) and
    ``local``: nearest real keys always attended (default 64), MagicPIG's static tokens (its
    system keeps 4 sink and 64 local tokens on the GPU). ``hyperplanes``: a ``(L, K, D)`` tensor of
    hash directions, used as given (its shape then sets L and K; ``num_bits``, ``num_tables`` and
    ``generator`` are not used); None: drawn at each call from ``generator`` (or the global RNG)."""

    num_bits: int = 8
    num_tables: int = 75
    min_matches: int = 2
    sinks: int = 4
    local: int = 64
    hyperplanes: Tensor | None = None
    generator: torch.Generator | None = None

    def __post_init__(self):
        check_int("magicpig", "num_bits", self.num_bits, minimum=1)
        check_int("magicpig", "num_tables", self.num_tables, minimum=1)
        check_int("magicpig", "min_matches", self.min_matches, minimum=0)
        check_int("magicpig", "sinks", self.sinks, minimum=0)
        check_int("magicpig", "local", self.local, minimum=0)
        check_tensor_option("magicpig", "hyperplanes", self.hyperplanes, "(L, K, D)")
        check_generator("magicpig", self.generator)
        _check_tables(self.num_tables, self.num_bits, self.min_matches)


def _check_tables(tables: int, bits: int, min_matches: int) -> None:
    """ValueError for more bits than a code holds or more matches than there are tables."""
    if bits > MAX_BITS:
        raise ValueError(f"magicpig: num_bits must be at most {MAX_BITS}, got {bits}")
    if min_matches > tables:
        raise ValueError(f"magicpig: min_matches must be at most the number of tables ({tables}), got {min_matches}")


def draw_hyperplanes(num_tables: int, num_bits: int, dim: int, *, generator: torch.Generator | None = None,
                     device: torch.device | str | None = None) -> Tensor:
    """``(num_tables, num_bits, dim)`` float32 i.i.d. N(0, 1) hash directions, drawn on the
    generator's device (CPU by default) and moved to ``device``."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    w = torch.randn(num_tables, num_bits, dim, generator=generator, dtype=torch.float32, device=gen_device)
    return w if device is None else w.to(device)


def simhash_codes(x: Tensor, hyperplanes: Tensor) -> Tensor:
    """``(B, H, L, n)`` int64: for each table, the K signs ``x . w > 0`` of ``x`` ``(B, H, n, D)``
    against its hyperplanes ``(L, K, D)``, packed into one integer."""
    L, K, D = hyperplanes.shape
    bits = (x @ hyperplanes.reshape(L * K, D).mT).unflatten(-1, (L, K)) > 0  # (B, H, n, L, K)
    code = bits[..., 0].to(torch.int64)
    for b in range(1, K):
        code = code * 2 + bits[..., b]
    return code.transpose(-1, -2)


def _binomial_term(p_table: Tensor, tables: int, j: int) -> Tensor:
    """``C(L, j) P^j (1 - P)^(L - j)``, from its logarithm (no overflow, 0^0 = 1)."""
    return torch.exp(math.log(math.comb(tables, j)) + torch.special.xlogy(j, p_table)
                     + torch.special.xlog1py(tables - j, -p_table))


def collision_log_probability(cos: Tensor, bits: int, tables: int, min_matches: int) -> Tensor:
    """``log u`` for cosines ``cos``: ``u = P[Binomial(L, P) >= min_matches]``, ``P = (1 -
    arccos(cos) / pi)^K`` the probability that one table of ``K`` SimHash bits gives two vectors
    at that angle the same code. ``u`` is one minus the head terms where that is at least 1e-2,
    else the sum of the first ``_TAIL_TERMS`` tail terms (by their recurrence from the first), so
    nothing cancels where ``u`` is small; floored at the smallest normal number of the dtype, never
    -inf. Against mpmath's incomplete beta, ``u`` in float64 is within 3e-14 (relative) for
    L <= 300 and ``min_matches`` <= 4, within 2e-7 up to L = 1000 and ``min_matches`` = 20; in
    float32 the rounding of the cosine dominates (near -1 it moves the angle by up to 3e-4)."""
    if min_matches == 0:
        return torch.zeros_like(cos)
    p_table = (1 - torch.arccos(cos.clamp(-1, 1)) / math.pi) ** bits
    head = sum(_binomial_term(p_table, tables, j) for j in range(min_matches))
    ratio = p_table / (1 - p_table).clamp_min(torch.finfo(cos.dtype).tiny)  # P / (1 - P), finite
    term = _binomial_term(p_table, tables, min_matches)
    tail = term.clone()
    for j in range(min_matches, min(tables, min_matches + _TAIL_TERMS - 1)):
        term = term.mul_(ratio).mul_((tables - j) / (j + 1))
        tail += term
    u = torch.where(head <= 1 - _TAIL_BELOW, 1 - head, tail)
    return u.clamp_min(torch.finfo(u.dtype).tiny).log()


def static_keys(real: Tensor | None, start: int, n: int, M: int, causal: bool, sinks: int, local: int,
                device: torch.device) -> Tensor:
    """``(B or 1, 1, n, M)`` bool: the keys attended exactly by the queries at positions ``start ..
    start + n``: the first ``sinks`` real keys, and the ``local`` real keys nearest the query,
    counted by rank among the real keys (causal: the last ``local`` up to the query, else those
    fewer than ``local`` away); query ``i`` stands at key position ``i`` (past the last key: at the
    last). ``real``: ``(B, M)`` bool, None when every key is real."""
    if real is None:
        real = torch.ones(1, M, dtype=torch.bool, device=device)
    rank = real.cumsum(-1) - 1  # (B, M): each real key's rank among the real keys
    static = (real & (rank < sinks))[:, None, :]
    if local > 0:
        # a query's rank: that of the last real key at or before its position
        at = rank[:, torch.arange(start, start + n, device=device).clamp(max=M - 1), None]
        near = (rank[:, None, :] > at - local) & (causal or (rank[:, None, :] < at + local))
        static = static | (real[:, None, :] & near)
    return static.expand(-1, n, -1)[:, None]


def _sampled(q_codes: Tensor, k_codes: Tensor, min_matches: int) -> Tensor:
    """``(B, H, n, M)`` bool: the keys whose codes ``(B, H, L, M)`` equal the queries' codes
    ``(B, H, L, n)`` in at least ``min_matches`` tables."""
    if min_matches == 0:
        return torch.ones(*q_codes.shape[:2], q_codes.shape[-1], k_codes.shape[-1], dtype=torch.bool,
                          device=q_codes.device)
    count = torch.zeros(*q_codes.shape[:2], q_codes.shape[-1], k_codes.shape[-1], device=q_codes.device,
                        dtype=torch.uint8 if q_codes.shape[2] < 256 else torch.int32)
    for table in range(q_codes.shape[2]):
        count += q_codes[:, :, table, :, None] == k_codes[:, :, table, None, :]
    return count >= min_matches


def _unit(x: Tensor) -> Tensor:
    """``x / |x|`` along the last dimension; a zero vector stays zero (cosine 0 with anything)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def flops(B, H, N, M, D, Dv, o):
    """Matmul FLOPs of one forward as computed: every logit, every cosine (for ``u``), the hash
    projections of queries and keys, and the weights times the values."""
    w = o.get("hyperplanes")
    hashes = o["num_tables"] * o["num_bits"] if w is None else w.shape[0] * w.shape[1]
    return 2 * B * H * (N * M * (2 * D + Dv) + (N + M) * hashes * D)


def expected_keys(q: Tensor, k: Tensor, causal: bool, o: MagicpigOptions) -> Tensor:
    """``(B, H, N)`` float64: the keys each query attends in expectation over the hash draws, its
    static keys plus the sum of ``u`` (the probability that a key is sampled) over its other
    visible keys; every key real, q ``(B, H, N, D)``, k ``(B, H, M, D)`` (the registry's
    ``expected_keys``)."""
    B, H, N, _ = q.shape
    M = k.shape[2]
    tables, bits = (o.num_tables, o.num_bits) if o.hyperplanes is None else o.hyperplanes.shape[:2]
    k_unit = _unit(k.double())
    step = max(1, _CHUNK_BYTES // max(1, 24 * B * H * M))
    out = []
    for a in range(0, N, step):
        qa = q[:, :, a: a + step].double()
        static = static_keys(None, a, qa.shape[2], M, causal, o.sinks, o.local, q.device)[0, 0]  # (n, M)
        at = torch.arange(a, a + qa.shape[2], device=q.device)[:, None]  # the queries' positions
        visible = (torch.arange(M, device=q.device)[None, :] <= at) | (not causal)
        u = collision_log_probability(_unit(qa) @ k_unit.mT, bits, tables, o.min_matches).exp()
        out.append((static & visible).sum(-1) + (u * (visible & ~static)).sum(-1))
    return torch.cat(out, 2)


def _fixed_draw(o: MagicpigOptions, head_dim: int, generator: torch.Generator) -> dict[str, Tensor]:
    """The hash directions ``hyperplanes`` drawn once (a layer keeps them as a buffer)."""
    return {"hyperplanes": draw_hyperplanes(o.num_tables, o.num_bits, head_dim, generator=generator)}


@register_method("magicpig", options=MagicpigOptions,
                 summary="LSH-sampled importance-sampling estimate of softmax attention (MagicPIG)",
                 causal=True, cross_attention=True, complexity="quadratic", flops=flops, query_local=True,
                 stochastic=True, fixed_draw=_fixed_draw, quality_reference=True, core="subquad.layers.drawn:DrawnCore",
                 expected_keys=expected_keys,
                 # few static keys and short codes, so tiny shapes sample (about a quarter of the
                 # random keys) rather than attend every key
                 test_options={"num_bits": 2, "num_tables": 4, "sinks": 1, "local": 2})
def magicpig_attention(q, k, v, key_padding_mask, causal, scale, *, num_bits, num_tables, min_matches, sinks,
                       local, hyperplanes, generator):
    """Shapes: q ``(B, H, N, D)``, k ``(B, H, M, D)``, v ``(B, H, M, Dv)`` -> ``(B, H, N, Dv)``.
    Causal: query ``i`` sees the keys ``<= i``. Padded keys never count; a query without a visible
    key outputs zeros. One draw of hyperplanes serves every batch item and head. Float32 math
    under autocast (float64 stays float64); returns the dtype of q.

    No budget mapping (the registry's ``budget_options``): the number of keys a query samples is
    random and depends on the angles of its keys, so no option gives it a fixed number of keys."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, D = q.shape
    M = k.shape[2]
    if hyperplanes is None:
        hyperplanes = draw_hyperplanes(num_tables, num_bits, D, generator=generator, device=q.device)
    elif hyperplanes.shape[-1] != D:
        raise ValueError(f"magicpig: hyperplanes must have shape (L, K, {D}), got {tuple(hyperplanes.shape)}")
    num_tables, num_bits = hyperplanes.shape[:2]
    _check_tables(num_tables, num_bits, min_matches)
    dtype = compute_dtype(q.dtype)
    real = None if key_padding_mask is None else ~key_padding_mask
    step = max(1, _CHUNK_BYTES // max(1, 48 * B * H * M))
    with compute_precision(q):
        w = hyperplanes.to(device=q.device, dtype=dtype)
        qc, kc, vc = q.to(dtype), drop_padded(k.to(dtype), key_padding_mask), drop_padded(v.to(dtype), key_padding_mask)
        with torch.no_grad():
            k_codes, k_unit = simhash_codes(kc.detach(), w), _unit(kc.detach())
        out = []
        for a in range(0, N, step):
            end = min(M, a + step) if causal else M  # causal: later keys are never seen by this chunk
            qa = qc[:, :, a: a + step]
            mask = None if key_padding_mask is None else key_padding_mask[:, :end]
            logits, visible = visible_logits(qa, kc[:, :, :end], a, mask, causal, scale)
            with torch.no_grad():
                static = static_keys(None if real is None else real[:, :end], a, qa.shape[2], end, causal, sinks,
                                     local, q.device)
                sampled = _sampled(simhash_codes(qa.detach(), w), k_codes[..., :end], min_matches)
                log_u = collision_log_probability(_unit(qa.detach()) @ k_unit[:, :, :end].mT, num_bits, num_tables,
                                                  min_matches)
                keep = visible & (static | sampled | logits.isnan())
                shift = torch.where(static, 0.0, log_u)  # u is a constant under autograd
            weights = torch.softmax((logits - shift).masked_fill(~keep, masked_fill_value(dtype)), -1) * keep
            out.append(weights @ vc[:, :, :end])
    return torch.cat(out, 2).to(q.dtype)
