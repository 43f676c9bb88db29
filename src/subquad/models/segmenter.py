"""A small semantic-segmentation network whose global-context block is any registered method.

HamNet's layout (Geng et al. 2021, "Is Attention Better Than Matrix Decomposition?", arXiv
2109.04553; the official code is Gsunshine/Enjoy-Hamburger) scaled down for a CPU:

``images (B, C_in, H, W)`` -> stem: three 3x3 conv-BN-ReLU (strides 2, 2, 1; HamNet has a dilated
ResNet to 1/8) to ``dim`` channels at 1/4 of the resolution -> ``depth`` context blocks -> align:
3x3 conv-BN-ReLU -> ``Dropout2d`` -> 1x1 classifier -> bilinear upsampling to ``(H, W)``.

A context block is Hamburger's V1 block: ``ReLU(z + BN(upper(core(lower(z)))))``, the "bread"
(1x1 convolutions, here ``Linear`` layers on the flattened map: ``lower`` with a bias, ``upper``
without) around a core that mixes the ``N = H/4 * W/4`` positions. The core is the run's method
(:func:`context_mixer`):

- a token mixer (``kind == "mixer"``: Hamburger's NMF, VQ or CD ham) is built by its registered
  module, which owns the breads (:class:`subquad.layers.hamburger.HamburgerMixer`: lower bread,
  ReLU for NMF, the ham, upper bread);
- an attention method (``kind == "attention"``) runs on the breads here through its layer core
  (:class:`subquad.layers.AttentionCore` or the entry's ``core``), with queries, keys and values all
  the lower bread's output, split into ``heads`` heads: no projections of its own, as the ham has
  none;
- :data:`~subquad.models.encoder.NO_MIXING` (``"none"``) has the identity between the breads: the
  block is a residual 1x1 convolution, context-free, with the parameters of every other variant.

So every variant has the same layers; only the core differs, and the cores of Hamburger, exact
softmax, linear and efficient attention hold no parameters. A core that learns tensors of its own
(Nyström's conv skip, Sinkhorn's sort network, LARA's landmark networks, hedgehog's feature maps)
adds them, and the model's parameter count shows it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.attention import AttentionCore
from ..registry import resolve_path
from .encoder import build_mixer, check_method

__all__ = ["Segmenter", "ContextBlock", "BreadMixer", "SelfAttentionCore", "context_mixer"]


class SelfAttentionCore(nn.Module):
    """A method's layer core as a token mixer without projections: ``x (B, N, C)`` split into
    ``heads`` heads is at once the queries, the keys and the values; ``(B, N, C)`` out."""

    def __init__(self, core: AttentionCore, heads: int):
        super().__init__()
        self.core, self.heads = core, heads

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        b, n, c = x.shape
        h = x.reshape(b, n, self.heads, c // self.heads).transpose(1, 2)
        return self.core(h, h, h, key_padding_mask, False).transpose(1, 2).reshape(b, n, c)


class BreadMixer(nn.Module):
    """``upper_bread(core(lower_bread(x)))`` on ``x (B, N, C)``: ``Linear(C, C)`` with a bias,
    the core, ``Linear(C, C)`` without, Xavier-uniform weights and a zero bias (the breads of
    :class:`~subquad.layers.hamburger.HamburgerMixer`, initialised as they are)."""

    def __init__(self, dim: int, core: nn.Module, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.lower_bread = nn.Linear(dim, dim, bias=True, **factory)
        self.core = core
        self.upper_bread = nn.Linear(dim, dim, bias=False, **factory)
        nn.init.xavier_uniform_(self.lower_bread.weight)
        nn.init.zeros_(self.lower_bread.bias)
        nn.init.xavier_uniform_(self.upper_bread.weight)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.upper_bread(self.core(self.lower_bread(x), key_padding_mask))


def context_mixer(method: str, dim: int, heads: int, *, attention_dropout: float = 0.0, device=None, dtype=None,
                  **options: Any) -> nn.Module:
    """The bread and core of a context block for ``method``, ``(B, N, dim) -> (B, N, dim)`` (see
    the module docstring). ``options``: the method's options (for attention, its core's module
    options too); ``attention_dropout``: on the weights of a method that forms them
    (``softmax``). Unknown methods or options raise ValueError naming what is allowed."""
    info = check_method(method)
    factory = {"device": device, "dtype": dtype}
    if info is not None and info.kind == "mixer":
        return build_mixer(method, dim, heads, attention_dropout=attention_dropout, **factory, **options)
    if info is None:  # no mixing: checked and built as every model builds it
        core = build_mixer(method, dim, heads, attention_dropout=attention_dropout, **factory, **options)
    else:
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        if attention_dropout and not info.exact:
            raise ValueError(f"attention_dropout={attention_dropout} needs attention weights, which method "
                             f"{method!r} never forms; use attention_dropout=0.0")
        core_cls = AttentionCore if info.core is None else resolve_path(info.core)
        core = SelfAttentionCore(core_cls(info, heads, dim // heads, options, dropout=attention_dropout, **factory),
                                 heads)
    return BreadMixer(dim, core, **factory)


class ContextBlock(nn.Module):
    """``ReLU(z + BN(mixer(z)))`` on a feature map ``z (B, C, H, W)``, the mixer running on its
    ``H * W`` positions flattened to ``(B, H * W, C)``."""

    def __init__(self, mixer: nn.Module, dim: int, device=None, dtype=None):
        super().__init__()
        self.mixer = mixer
        self.norm = nn.BatchNorm2d(dim, device=device, dtype=dtype)

    def forward(self, z: Tensor) -> Tensor:
        b, c, h, w = z.shape
        y = self.mixer(z.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(b, c, h, w)
        return F.relu(z + self.norm(y))


def _conv_bn_relu(c_in: int, c_out: int, stride: int, factory: dict) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False, **factory),
                         nn.BatchNorm2d(c_out, **factory), nn.ReLU())


class Segmenter(nn.Module):
    """Per-pixel classifier of images with a global-context block of any method (module docstring).

    Args:
        in_channels: channels of the images.
        num_classes: classes per pixel.
        method: the context blocks' core: a name from :func:`subquad.list_methods`, or ``"none"``.
        method_options: its options (see :func:`context_mixer`).
        dim: channels of the 1/4-resolution feature map (the stem's first conv has ``dim // 2``).
        depth: context blocks (HamNet has one).
        heads: heads of an attention core, groups of Hamburger's ham.
        dropout: ``Dropout2d`` before the classifier (HamNet: 0.1).
        attention_dropout: on the attention weights of ``softmax``.

    Convolutions are initialised ``kaiming_normal_(mode="fan_out")`` (as Hamburger's), norms with
    weight 1 and bias 0, the breads as :class:`BreadMixer` says.

    ``forward(images (B, in_channels, H, W), key_padding_mask=None, select=None)`` -> logits
    ``(B, H, W, num_classes)``, or with ``select`` (bool ``(B, H, W)``) the logits of the selected
    pixels, ``(K, num_classes)`` in row-major order. ``key_padding_mask`` (bool ``(B, H, W)``) is
    accepted for the trainer's interface; images are never padded, so a True in it is a ValueError.
    """

    def __init__(self, in_channels: int, num_classes: int, *, method: str = "softmax",
                 method_options: dict[str, Any] | None = None, dim: int = 64, depth: int = 1, heads: int = 1,
                 dropout: float = 0.0, attention_dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes), ("dim", dim),
                            ("depth", depth), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        factory = {"device": device, "dtype": dtype}
        self.method = method
        self.method_options = dict(method_options or {})
        half = max(1, dim // 2)
        self.stem = nn.Sequential(_conv_bn_relu(in_channels, half, 2, factory), _conv_bn_relu(half, dim, 2, factory),
                                  _conv_bn_relu(dim, dim, 1, factory))
        self.blocks = nn.ModuleList(
            ContextBlock(context_mixer(method, dim, heads, attention_dropout=attention_dropout, **factory,
                                       **self.method_options), dim, **factory)
            for _ in range(depth))
        self.align = _conv_bn_relu(dim, dim, 1, factory)
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(dim, num_classes, 1, **factory)
        for module in (self.stem, self.align):
            for m in module.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: Tensor, key_padding_mask: Tensor | None = None, select: Tensor | None = None) -> Tensor:
        if not isinstance(images, Tensor) or images.dim() != 4 or not images.is_floating_point():
            what = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, Tensor) else type(images).__name__
            raise ValueError(f"images must be a float tensor (B, C, H, W), got {what}")
        pixels = (images.shape[0], *images.shape[2:])
        for name, mask in (("key_padding_mask", key_padding_mask), ("select", select)):
            if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != pixels):
                raise ValueError(f"{name} must be a bool tensor (B, H, W) = {pixels}, got {mask.dtype} "
                                 f"{tuple(mask.shape)}")
        if key_padding_mask is not None and bool(key_padding_mask.any()):
            raise ValueError("the segmenter's images are never padded: key_padding_mask must be all False")
        z = self.stem(images)
        for block in self.blocks:
            z = block(z)
        logits = self.classifier(self.dropout(self.align(z)))
        logits = F.interpolate(logits, size=images.shape[2:], mode="bilinear", align_corners=False)
        logits = logits.permute(0, 2, 3, 1)
        return logits if select is None else logits[select]

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.method_options.items())
        return f"method={self.method!r}" + (f", {opts}" if opts else "")
