"""The recurrent state of causal kernel attention, for decoding one token (or a few) at a time.

Causal kernel attention ``out_n = phi(q_n) . S_n / phi(q_n) . z_n`` with ``S_n = sum_{m <= n}
phi(k_m) v_m^T`` and ``z_n = sum_{m <= n} phi(k_m)`` (Katharopoulos et al. 2020, "Transformers are
RNNs", Section 3.4) needs only ``S`` and ``z`` of the past: a decoder keeps them, ``(F, Dv + 1)``
per head (``z`` as the last column), and each new token costs ``O(F Dv)`` time and no new memory,
whatever the context length. :class:`KernelState` computes the same as the parallel causal form
(:func:`subquad.ops.linear.kernel_attention`) over prefill and steps alike.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from . import _causal_chunked, _safe_den

__all__ = ["KernelState"]


class KernelState:
    """``S`` and ``z`` of the keys seen so far, ``sums`` ``(B, H, F, Dv + 1)`` (None before the
    first call), and ``seen``, how many tokens (padding included) they cover.

    ``chunk_size``: tokens per chunk when several arrive at once (a prefill), as in the op."""

    def __init__(self, chunk_size: int = 64):
        self.chunk_size = int(chunk_size)
        self.sums: Tensor | None = None
        self.seen = 0

    def attend(self, phi_q: Tensor, phi_k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The causal outputs of ``n`` new tokens, each over every earlier token and the new ones up
        to itself, then the new keys join the state. phi_q, phi_k ``(B, H, n, F)`` (non-negative),
        v ``(B, H, n, Dv)``, ``key_padding_mask`` bool ``(B, n)``, True = padding (such keys add
        nothing) -> ``(B, H, n, Dv)``. A query that sees no real key outputs 0, as in the op."""
        if phi_q.shape[:3] != phi_k.shape[:3] or phi_k.shape[:3] != v.shape[:3]:
            raise ValueError(f"KernelState: phi_q, phi_k and v must share (B, H, n), got {tuple(phi_q.shape)}, "
                             f"{tuple(phi_k.shape)} and {tuple(v.shape)}")
        if key_padding_mask is not None:
            phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        v1 = F.pad(v, (0, 1), value=1.0)
        n = phi_q.shape[2]
        if n == 1:  # one token: itself and the past, no chunked form
            sums = phi_k.transpose(-2, -1) @ v1
            if self.sums is not None:
                sums = sums + self.sums
            out = phi_q @ sums
        else:
            out = _causal_chunked(phi_q, phi_k, v1, self.chunk_size)
            sums = phi_k.transpose(-2, -1) @ v1
            if self.sums is not None:
                out = out + phi_q @ self.sums
                sums = sums + self.sums
        self.sums = sums
        self.seen += n
        return out[..., :-1] / _safe_den(out[..., -1:])

    def select(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` (beam search's reordering)."""
        if self.sums is not None:
            self.sums = self.sums.index_select(0, index.to(self.sums.device))

    def nbytes(self) -> int:
        """Memory held: ``B H F (Dv + 1)`` numbers, whatever ``seen`` is."""
        return 0 if self.sums is None else self.sums.numel() * self.sums.element_size()

