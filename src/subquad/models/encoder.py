"""A small encoder whose token mixer is any registered method, for sequence or token classification.

``tokens (B, N)`` -> token embedding + positions (learned or sinusoidal) -> ``depth`` pre-LN
blocks ``x + Dropout(mixer(LN(x)))``, ``x + FFN(LN(x))`` -> final LN -> mean over real tokens
-> classifier (or, with ``pooling="none"``, the classifier at every position). The key padding
mask (True = padding) reaches every mixer; padded positions never influence real ones, and
pooling averages real tokens only.

:func:`build_mixer` is the one place that turns a method name and its options into a module:
attention methods (``kind == "attention"``) become :class:`subquad.MultiheadAttention`
self-attention, token mixers (``kind == "mixer"``, e.g. Hamburger) are built by their registered
module class. A method registered later plugs in with no change here. :data:`NO_MIXING`
(``"none"``) is no method but the absence of one: its mixer is the identity, the baseline of a
model without context.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.attention import MultiheadAttention
from ..registry import MethodInfo, get_method

__all__ = [
    "NO_MIXING",
    "build_mixer",
    "check_method",
    "supports_attention_dropout",
    "NoMixing",
    "AttentionMixer",
    "EncoderBlock",
    "Encoder",
    "sinusoidal_positions",
    "cross_entropy",
]

POSITIONS = ("learned", "sinusoidal")
POOLINGS = ("mean", "cls", "none")
#: the method name of no token mixing: not in the registry, every model builds it as the identity
NO_MIXING = "none"


def check_method(method: str) -> MethodInfo | None:
    """The registry entry of ``method``, None for :data:`NO_MIXING`; ValueError listing the known
    methods for any other name."""
    return None if method == NO_MIXING else get_method(method)


class NoMixing(nn.Module):
    """The mixer of :data:`NO_MIXING`: ``forward(x, key_padding_mask=None)`` returns ``x`` (no
    position sees another), no parameters, no options."""

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return x


class AttentionMixer(nn.Module):
    """Self-attention as a token mixer: ``forward(x (B, N, C), key_padding_mask (B, N))``."""

    def __init__(self, attention: MultiheadAttention):
        super().__init__()
        self.attention = attention

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.attention(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]


def build_mixer(method: str, dim: int, heads: int, *, attention_dropout: float = 0.0, device=None,
                dtype=None, **options: Any) -> nn.Module:
    """A token mixer ``(B, N, dim) -> (B, N, dim)`` for any registered method.

    ``forward(x, key_padding_mask=None)`` with ``key_padding_mask`` bool ``(B, N)``, True =
    padding. ``options`` are the method's options (its op options and, for attention, its
    core's module options such as Nyström's ``conv_kernel_size``). ``attention_dropout`` is
    dropout on attention weights; only a method that forms the weights (``softmax``) has it,
    elsewhere a non-zero value is a ValueError (see :func:`supports_attention_dropout`).
    Unknown methods or options raise ValueError naming what is allowed. :data:`NO_MIXING` builds
    :class:`NoMixing` (no options, no attention dropout).
    """
    info = check_method(method)
    if info is None:
        if options or attention_dropout:
            raise ValueError(f"method {method!r} (no token mixing) has no options and no attention dropout, got "
                             f"{sorted(options) or f'attention_dropout={attention_dropout}'}")
        return NoMixing()
    factory = {"device": device, "dtype": dtype}
    if info.kind == "attention":
        if attention_dropout and not supports_attention_dropout(method):
            raise ValueError(f"attention_dropout={attention_dropout} needs attention weights, which method "
                             f"{method!r} never forms; use attention_dropout=0.0")
        mha = MultiheadAttention(dim, heads, dropout=attention_dropout, batch_first=True, method=method,
                                 **factory, **options)
        return AttentionMixer(mha)
    if info.kind == "mixer":
        if attention_dropout:
            raise ValueError(f"method {method!r} is a token mixer without attention weights; "
                             "use attention_dropout=0.0")
        if info.module is None:  # pragma: no cover - register_mixer always sets it
            raise ValueError(f"mixer {method!r} has no module")
        info.make_options(**options)  # unknown or out-of-range options: a clear error now
        return info.module(dim, heads, **factory, **options)
    raise ValueError(f"method {method!r} has unknown kind {info.kind!r}")


def supports_attention_dropout(method: str) -> bool:
    """Whether ``method`` has dropout on attention weights (only exact ``softmax``)."""
    info = check_method(method)
    return info is not None and info.exact


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """Fixed ``(length, dim)`` sin/cos positions (Vaswani et al.), float32: feature pairs
    ``(sin, cos)`` of ``pos / 10000^(2i/dim)``."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    out = torch.zeros(length, dim, dtype=torch.float64)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return out.float()


class ShortConv(nn.Module):
    """A causal depthwise convolution of width ``k`` along the sequence: ``out_t = b + sum_{j < k}
    w_j * x_{t-j}`` per channel, so each token sees the few tokens just before it (the short
    filter of Zoology's BaseConv, Arora et al. 2023, and H3's shift SSM). Padded positions are
    zeroed first. ``forward(x (B, N, C), key_padding_mask (B, N) | None)``."""

    #: set inside :func:`subquad.distributed.context_parallel`: ``x`` is this rank's shard of the
    #: sequence, and the tokens before it come from the ranks before
    sequence_shards = None

    def __init__(self, dim: int, kernel_size: int, device=None, dtype=None):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size, groups=dim, padding=kernel_size - 1, device=device, dtype=dtype)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        if key_padding_mask is not None:
            x = x.masked_fill(key_padding_mask[..., None], 0.0)
        if self.sequence_shards is not None:
            return self._sharded(x)
        return self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)

    def _sharded(self, x: Tensor) -> Tensor:
        """The convolution of this rank's shard, its first outputs reading the last ``k - 1``
        tokens of the ranks before (zeros before the sequence): every rank's last ``k - 1``
        tokens are all-gathered (with their gradients returned in backward)."""
        shards, h = self.sequence_shards, self.conv.kernel_size[0] - 1
        if not h:
            return self.conv(x.transpose(1, 2)).transpose(1, 2)
        lengths = [n for n, in shards.gather_ints([x.shape[1]], x.device)]
        tail = F.pad(x[:, -h:], (0, 0, h - min(h, x.shape[1]), 0))  # (B, h, C), zeros before a short shard
        tails = shards.gather(tail)  # (R, B, h, C)
        # every rank's real tail tokens in sequence order after h zeros; this rank's halo ends where
        # its own tokens start (built from all of them on every rank, so every rank's backward
        # reaches the gather's all-reduce)
        real = [tails[r, :, h - min(h, n):] for r, n in enumerate(lengths)]
        end = h + sum(min(h, n) for n in lengths[:shards.rank])
        halo = torch.cat([x.new_zeros(x.shape[0], h, x.shape[2]), *real], 1)[:, end - h: end]
        y = torch.cat([halo, x], 1).transpose(1, 2)
        return F.conv1d(y, self.conv.weight, self.conv.bias, groups=self.conv.groups).transpose(1, 2)


class EncoderBlock(nn.Module):
    """Pre-LN block: ``x + Dropout(mixer(LN(x), mask))`` then ``x + FFN(LN(x))`` with
    ``FFN = Linear(dim, ffn_dim), GELU, Dropout, Linear(ffn_dim, dim), Dropout``; with
    ``conv_kernel_size > 0``, first ``x + ShortConv(LN(x))``."""

    def __init__(self, mixer: nn.Module, dim: int, ffn_dim: int, dropout: float, device=None, dtype=None,
                 conv_kernel_size: int = 0):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if conv_kernel_size:
            self.norm0 = nn.LayerNorm(dim, **factory)
            self.conv = ShortConv(dim, conv_kernel_size, **factory)
        self.norm1 = nn.LayerNorm(dim, **factory)
        self.mixer = mixer
        self.dropout1 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim, **factory)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_dim, **factory),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(ffn_dim, dim, **factory),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        if hasattr(self, "conv"):
            x = x + self.conv(self.norm0(x), key_padding_mask)
        x = x + self.dropout1(self.mixer(self.norm1(x), key_padding_mask=key_padding_mask))
        return x + self.ffn(self.norm2(x))


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _dropout(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


class Encoder(nn.Module):
    """Encoder for sequence classification with any registered token mixer.

    Args:
        vocab_size: token ids are ``0 .. vocab_size - 1`` (the padding id is the caller's; the
            mask says which positions are padding).
        num_classes: size of the output.
        method: a name from :func:`subquad.list_methods` (attention or mixer), or :data:`NO_MIXING`.
        method_options: that method's options (see :func:`build_mixer`).
        dim, depth, heads, ffn_dim: model width, number of blocks, heads, FFN width.
        max_len: longest input (size of the learned position table).
        positions: ``"learned"`` (``N(0, 0.02)`` table) or ``"sinusoidal"`` (fixed).
        dropout: on embeddings, mixer output and FFN. attention_dropout: on attention weights
            (``softmax`` only).
        head_hidden: classifier ``Linear(dim, head_hidden), ReLU, Linear(head_hidden, classes)``;
            0 for a single ``Linear(dim, classes)``.
        conv_kernel_size: 0 (default), or the width of a :class:`ShortConv` before each block's
            mixer (Zoology's MQAR models have one).
        pooling: ``"mean"`` over real tokens, or ``"cls"``: a learned token (initialised to zeros)
            is put before the sequence, before the positions are added (the table then has
            ``max_len + 1`` rows), and its final state is the summary, as in the LRA code
            (google-research/long-range-arena, ``classifier_pool="CLS"``); ``"none"``: no summary, the
            classifier reads every position (token-level tasks such as MQAR).

    ``forward(tokens (B, N) int64, key_padding_mask (B, N) bool | None)`` -> logits ``(B, classes)``,
    or ``(B, N, classes)`` with ``pooling="none"`` (padded positions' logits are meaningless).
    With mean pooling a row with no real token pools to zeros.
    """

    def __init__(self, vocab_size: int, num_classes: int, *, method: str = "softmax",
                 method_options: dict[str, Any] | None = None, dim: int = 64, depth: int = 2, heads: int = 2,
                 ffn_dim: int = 128, max_len: int = 2048, positions: str = "learned", dropout: float = 0.1,
                 attention_dropout: float = 0.0, head_hidden: int = 128, pooling: str = "mean",
                 conv_kernel_size: int = 0, device=None, dtype=None):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("num_classes", num_classes), ("dim", dim),
                            ("depth", depth), ("heads", heads), ("ffn_dim", ffn_dim), ("max_len", max_len)):
            _positive_int(name, value)
        for name, value in (("head_hidden", head_hidden), ("conv_kernel_size", conv_kernel_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {list(POSITIONS)}, got {positions!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
        _dropout("dropout", dropout)
        _dropout("attention_dropout", attention_dropout)
        if method_options is not None and not isinstance(method_options, dict):
            raise TypeError(f"method_options must be a dict, got {type(method_options).__name__}")
        factory = {"device": device, "dtype": dtype}
        self.method = method
        self.method_options = dict(method_options or {})
        self.max_len = max_len
        self.positions = positions
        self.pooling = pooling
        self.token_embedding = nn.Embedding(vocab_size, dim, **factory)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        table_len = max_len + (pooling == "cls")
        if pooling == "cls":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, dim, **factory))
        if positions == "learned":
            self.position_embedding = nn.Parameter(torch.empty(table_len, dim, **factory))
            nn.init.normal_(self.position_embedding, std=0.02)
        else:
            table = sinusoidal_positions(table_len, dim)
            table = table.to(device=device, dtype=dtype or torch.get_default_dtype())
            self.register_buffer("position_embedding", table, persistent=False)
        self.embed_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            EncoderBlock(build_mixer(method, dim, heads, attention_dropout=attention_dropout, **factory,
                                     **self.method_options), dim, ffn_dim, dropout, **factory,
                         conv_kernel_size=conv_kernel_size)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim, **factory)
        if head_hidden:
            self.head = nn.Sequential(nn.Linear(dim, head_hidden, **factory), nn.ReLU(),
                                      nn.Linear(head_hidden, num_classes, **factory))
        else:
            self.head = nn.Linear(dim, num_classes, **factory)

    #: set inside :func:`subquad.distributed.context_parallel`: ``tokens`` are this rank's shard of
    #: the sequence (positions offset by the ranks before)
    sequence_shards = None

    def check_context_parallel(self) -> None:
        """ValueError unless this encoder can run on shards of the sequence: labels per position
        (``pooling="none"``; a summary of the whole sequence is not sharded) and a method with a
        context-parallel form (or no mixing)."""
        from ..distributed import supported_methods

        if self.pooling != "none":
            raise ValueError(f"context parallelism needs an encoder with outputs per position (pooling='none'), "
                             f"not pooling={self.pooling!r}")
        if self.method != NO_MIXING and self.method not in supported_methods():
            raise ValueError(f"method {self.method!r} has no context-parallel form; supported: "
                             f"{supported_methods()} (or {NO_MIXING!r})")

    def _first_position(self, n: int, device) -> int:
        """The position of this shard's first token (0 on one process); ValueError when the whole
        sequence is longer than ``max_len``."""
        if self.sequence_shards is None:
            total, first = n, 0
        else:
            lengths = [m for m, in self.sequence_shards.gather_ints([n], device)]
            total, first = sum(lengths), sum(lengths[:self.sequence_shards.rank])
        if total > self.max_len:
            raise ValueError(f"sequence length {total} exceeds max_len={self.max_len}")
        return first

    def encode(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Token states ``(B, N, dim)`` after the final LayerNorm (padded rows are meaningless);
        ``(B, 1 + N, dim)`` with the summary token first when ``pooling="cls"``."""
        integer = (torch.int64, torch.int32)
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype not in integer:
            what = (f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, Tensor)
                    else type(tokens).__name__)
            raise ValueError(f"tokens must be an integer tensor (B, N), got {what}")
        first = self._first_position(tokens.shape[1], tokens.device)
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError("key_padding_mask must be a bool tensor (True = padding)")
            if key_padding_mask.shape != tokens.shape:
                raise ValueError(f"key_padding_mask must have the shape of tokens {tuple(tokens.shape)}, "
                                 f"got {tuple(key_padding_mask.shape)}")
        x = self.token_embedding(tokens)
        if self.pooling == "cls":
            x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1).to(x.dtype), x], dim=1)
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (1, 0), value=False)
        x = x + self.position_embedding[first: first + x.shape[1]]
        x = self.embed_dropout(x)
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return self.norm(x)

    def pool(self, states: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """Mean of ``states (B, N, C)`` over real tokens -> ``(B, C)``; the first state with
        ``pooling="cls"``; ``states`` as they are with ``pooling="none"``."""
        if self.pooling == "none":
            return states
        if self.pooling == "cls":
            return states[:, 0]
        if key_padding_mask is None:
            return states.mean(dim=1)
        total = states.masked_fill(key_padding_mask[:, :, None], 0.0).sum(dim=1)
        count = (~key_padding_mask).sum(dim=1, keepdim=True).clamp_min(1).to(states.dtype)
        return total / count

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None, select: Tensor | None = None) -> Tensor:
        """Logits (see the class docstring). ``select`` (bool ``(B, N)``, ``pooling="none"`` only):
        the logits of the selected positions alone, ``(K, classes)`` in row-major order, so a task
        with few labelled positions does not pay the classifier at every position."""
        states = self.pool(self.encode(tokens, key_padding_mask), key_padding_mask)
        if select is not None:
            if self.pooling != "none":
                raise ValueError("select needs pooling='none' (logits per position)")
            if select.shape != tokens.shape or select.dtype != torch.bool:
                raise ValueError(f"select must be a bool tensor of the tokens' shape {tuple(tokens.shape)}")
            states = states[select]
        return self.head(states)

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.method_options.items())
        return (f"method={self.method!r}" + (f", {opts}" if opts else "") + f", positions={self.positions!r}, "
                f"pooling={self.pooling!r}")


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy in float32 (logits may be half precision under autocast)."""
    return F.cross_entropy(logits.float(), labels)
