"""Slow, obvious references of Sparse Sinkhorn attention and of its LRA compatibility mode, for
the tests (the library never imports them)."""

from __future__ import annotations

import torch

__all__ = ["lra_sinkhorn_attention_reference", "sinkhorn_attention_reference"]


def _reference_padding(q, k, v, key_padding_mask, block_size):
    """For the references: ``(b, NB, L, keep, qp, kp, vp)`` with q, k, v zero-padded to
    ``L = NB * b`` tokens, ``keep`` bool ``(B, L)`` (True = real token) and the padded keys and
    values zeroed."""
    B, H, N, D = q.shape
    b = min(block_size, N)
    nb = -(-N // b)
    L = nb * b
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[:, N:] = False
    if key_padding_mask is not None:
        keep[:, :N] = ~key_padding_mask
    zeros = torch.zeros(B, H, L - N, D, dtype=q.dtype)
    qp, kp = torch.cat([q, zeros], 2), torch.cat([k, zeros], 2)
    vp = torch.cat([v, torch.zeros(B, H, L - N, v.shape[-1], dtype=v.dtype)], 2)
    return b, nb, L, keep, qp, kp * keep[:, None, :, None], vp * keep[:, None, :, None]


def _reference_logits(qx, kx, real, b, nb, causal, scale):
    """Default sorting logits of one head by loops over blocks: ``R_ij = <mean q_i, mean k_j> *
    scale`` over real tokens (causal: row i averages positions ``0 .. i * b``)."""

    def mean(x, positions):
        sel = [p for p in positions if real[p]]
        return x[sel].mean(0) if sel else torch.zeros(x.shape[-1], dtype=x.dtype)

    r = torch.zeros(nb, nb, dtype=qx.dtype)
    for i in range(nb):
        rows = range(i * b + 1) if causal else range(i * b, (i + 1) * b)
        qi = mean(qx, rows)
        for j in range(nb):
            r[i, j] = (qi @ mean(kx, range(j * b, (j + 1) * b))) * scale
    return r


def _reference_permutations(r, allowed, *, tau, top_blocks, sinkhorn_iters, causal, tiny):
    """``top_blocks`` soft permutations of one head, by division in probability space; each
    excludes what the earlier ones chose."""
    alpha = torch.exp(r / tau - (r / tau).max()) * allowed
    perms = []
    for _ in range(top_blocks):
        a = alpha.clone()
        for p in perms:
            a = a * (1 - p).clamp_min(tiny)
        rounds = 1 if causal else sinkhorn_iters
        for _ in range(rounds):
            rs = a.sum(1, keepdim=True)
            a = torch.where(rs > 0, a / rs.clamp_min(tiny), a)
            if causal:
                break
            cs = a.sum(0, keepdim=True)
            a = torch.where(cs > 0, a / cs.clamp_min(tiny), a)
        perms.append(a)
    return perms


def _reference_slots(i, perms, kx, vx, real, n_sources, b, nb):
    """Sorted keys, values and logit biases (None = hidden) of destination block i."""
    ks, vs, ok = [], [], []
    for m, p in enumerate(perms):
        for s in range(b):
            src = [j * b + s for j in range(nb)]
            ks.append(sum(p[i, j] * kx[src[j]] for j in range(nb)))
            vs.append(sum(p[i, j] * vx[src[j]] for j in range(nb)))
            mass = sum(p[i, j] * float(real[src[j]]) for j in range(nb))
            usable = bool(n_sources[i] > m) and bool(mass > 0)
            ok.append(torch.log(mass / p[i].sum()) if usable else None)
    return ks, vs, ok


def sinkhorn_attention_reference(
    q, k, v, key_padding_mask=None, causal=False, scale=None, *, block_size=64, sinkhorn_iters=7,
    tau=0.75, top_blocks=1, sortcut_blocks=0, sort_logits=None, noise=None,
):
    """Slow, obvious reference of :func:`subquad.ops.sinkhorn.sinkhorn_attention`: explicit zero
    padding, summaries and logits by loops over blocks, Sinkhorn by division in probability
    space, and for every query an explicit list of keys and one softmax. ``noise``: Gumbel noise
    ``(B, H, NB, NB)`` to add to the logits (None: none)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, D = q.shape
    b, nb, L, keep, qp, kp, vp = _reference_padding(q, k, v, key_padding_mask, block_size)
    out = torch.zeros(B, H, L, v.shape[-1], dtype=v.dtype)
    for bi in range(B):
        valid = [bool(keep[bi, i * b:(i + 1) * b].any()) for i in range(nb)]
        allowed = torch.zeros(nb, nb, dtype=torch.bool)
        for i in range(nb):
            for j in range(nb):
                allowed[i, j] = valid[j] and (j < i if causal else valid[i])
        for h in range(H):
            if sort_logits is None:
                r = _reference_logits(qp[bi, h], kp[bi, h], keep[bi], b, nb, causal, scale)
            else:
                r = sort_logits[min(bi, sort_logits.shape[0] - 1), min(h, sort_logits.shape[1] - 1)].clone()
            if noise is not None:
                r = r + noise[bi, h]
            perms = _reference_permutations(r, allowed, tau=tau, top_blocks=top_blocks, sinkhorn_iters=sinkhorn_iters,
                                            causal=causal, tiny=torch.finfo(q.dtype).tiny)
            slot_args = (perms, kp[bi, h], vp[bi, h], keep[bi], allowed.sum(1), b, nb)
            if sortcut_blocks:
                ks, vs, ok = [], [], []
                for i in range(min(sortcut_blocks, nb)):
                    a, c, d = _reference_slots(i, *slot_args)
                    ks, vs, ok = ks + a, vs + c, ok + d
            for i in range(nb):
                if not sortcut_blocks:
                    ks, vs, ok = _reference_slots(i, *slot_args)
                for t in range(i * b, (i + 1) * b):
                    keys = [x for x, u in zip(ks, ok) if u is not None]
                    vals = [x for x, u in zip(vs, ok) if u is not None]
                    bias = [u for u in ok if u is not None]
                    if not sortcut_blocks:
                        for s in range(i * b, (i + 1) * b):
                            if keep[bi, s] and (not causal or s <= t):
                                keys.append(kp[bi, h, s])
                                vals.append(vp[bi, h, s])
                                bias.append(torch.zeros((), dtype=q.dtype))
                    if not keys:
                        continue
                    logits = torch.stack(keys) @ qp[bi, h, t] * scale + torch.stack(bias)
                    w = torch.softmax(logits, 0)
                    out[bi, h, t] = w @ torch.stack(vals)
    return out[:, :, :N]


def lra_sinkhorn_attention_reference(q, k, v, permutation, key_padding_mask=None, block_size=50, scale=None):
    """Slow reference of :func:`subquad.ops.sinkhorn.lra_sinkhorn_attention`: the LRA einsum written out literally
    (``sorted[s, n] = sum_k sum_l key[s, k] P[n, l]``) and explicit softmaxes per query."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, H, N, D = q.shape
    b, nb, L, keep, qp, kp, vp = _reference_padding(q, k, v, key_padding_mask, block_size)
    # LRA layout: (B, b, NB, H, d) with [s, n] = position s * NB + n
    kb = kp.permute(0, 2, 1, 3).reshape(B, b, nb, H, D)
    vb = vp.permute(0, 2, 1, 3).reshape(B, b, nb, H, -1)
    perm = permutation.permute(0, 2, 1, 3)  # (B, NB, H, P)
    sorted_k = torch.einsum("bskhd,bnhl->bsnhd", kb, perm)
    sorted_v = torch.einsum("bskhd,bnhl->bsnhd", vb, perm)
    out = torch.zeros(B, H, L, v.shape[-1], dtype=v.dtype)
    for bi in range(B):
        for h in range(H):
            for n in range(nb):
                positions = [s * nb + n for s in range(b)]
                chunk_real = [bool(keep[bi, s * nb:(s + 1) * nb].any()) for s in range(b)]
                for pos in positions:
                    y = torch.zeros(v.shape[-1], dtype=v.dtype)
                    real = [p for p in positions if keep[bi, p]]
                    if real:
                        w = torch.softmax(kp[bi, h, real] @ qp[bi, h, pos] * scale, 0)
                        y = y + w @ vp[bi, h, real]
                    slots = [s for s in range(b) if chunk_real[s]]
                    if slots:
                        w = torch.softmax(sorted_k[bi, slots, n, h] @ qp[bi, h, pos] * scale, 0)
                        y = y + w @ sorted_v[bi, slots, n, h]
                    out[bi, h, pos] = y
    return out[:, :, :N]
