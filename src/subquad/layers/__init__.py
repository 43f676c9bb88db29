"""``nn.Module`` layers that own parameters and call the ops."""

from .attention import AttentionCore, MultiheadAttention, register_core

__all__ = ["MultiheadAttention", "AttentionCore", "register_core"]
