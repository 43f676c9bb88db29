"""The attention core of Nyström attention: the optional depthwise conv skip on V."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from .attention import AttentionCore

__all__ = ["NystromCore", "NystromModuleOptions"]


@dataclass
class NystromModuleOptions:
    """``conv_kernel_size``: the odd width of the depthwise conv skip on V (None: no skip)."""

    conv_kernel_size: int | None = None

    def __post_init__(self):
        ks = self.conv_kernel_size
        if ks is not None and (isinstance(ks, bool) or not isinstance(ks, int) or ks < 1 or ks % 2 == 0):
            raise ValueError(f"nystrom: conv_kernel_size must be an odd positive int or None, got {ks!r}")


class NystromCore(AttentionCore):
    """Nyström attention plus the optional depthwise conv skip on V (``conv_kernel_size``,
    odd, default off): one length-k kernel per head along the sequence, shared across the
    head's features (``Conv2d(H, H, (k, 1), groups=H)``), added to the attention output.
    Padded values are zeroed before the conv."""

    module_options = NystromModuleOptions

    def __init__(self, method, num_heads, head_dim, options, *, dropout=0.0, device=None, dtype=None):
        super().__init__(method, num_heads, head_dim, options)
        ks = self.module.conv_kernel_size
        self.conv = None
        if ks is not None:
            self.conv = nn.Conv2d(num_heads, num_heads, (ks, 1), padding=(ks // 2, 0), groups=num_heads,
                                  bias=False, device=device, dtype=dtype)

    def forward(self, q, k, v, key_padding_mask, causal, extra_keys=0):
        out = super().forward(q, k, v, key_padding_mask, causal)
        if self.conv is not None:
            m = v.shape[2] - extra_keys  # the conv runs over the input's values, not the extras
            if q.shape[2] != m:
                raise ValueError("nystrom: the conv skip needs equal query and key lengths")
            v = v[:, :, :m]
            if key_padding_mask is not None:
                v = v.masked_fill(key_padding_mask[:, None, :m, None], 0.0)
            out = out + self.conv(v)
        return out

    def extra_repr(self):
        return super().extra_repr() + (f", conv_kernel_size={self.conv.kernel_size[0]}" if self.conv else "")
