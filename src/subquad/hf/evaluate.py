"""How close a retrofitted encoder stays to the exact one: sentence-embedding agreement.

Embeddings are mean-pooled last hidden states over real tokens (what sentence-transformers does
for all-MiniLM-L6-v2). Against the same model with exact attention we report the cosine of each
text's two embeddings (mean and minimum over texts) and the top-1 nearest-neighbour agreement:
the fraction of texts whose most similar other text is the same under both models.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .retrofit import retrofit_layers, set_mode

__all__ = ["embed", "embedding_agreement", "compare_to_exact"]


def embed(model: nn.Module, tokenizer, texts: list[str], *, batch_size: int = 16, max_length: int = 512) -> Tensor:
    """Mean-pooled last hidden states ``(len(texts), C)``; texts are batched with padding."""
    model.eval()
    p = next(model.parameters())
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i: i + batch_size], return_tensors="pt", padding=True, truncation=True,
                            max_length=max_length)
            enc = {k: v.to(p.device) for k, v in enc.items()}
            h = model(**enc).last_hidden_state.float()
            keep = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            out.append((h * keep).sum(1) / keep.sum(1).clamp_min(1.0))
    return torch.cat(out)


def embedding_agreement(exact: Tensor, approx: Tensor) -> dict[str, float]:
    """Mean and minimum cosine between rows, and top-1 nearest-neighbour agreement."""
    cos = F.cosine_similarity(exact, approx, dim=-1)
    a, b = F.normalize(exact, dim=-1), F.normalize(approx, dim=-1)
    eye = torch.eye(len(a), dtype=torch.bool)
    nn_a = (a @ a.T).masked_fill(eye, -2.0).argmax(-1)
    nn_b = (b @ b.T).masked_fill(eye, -2.0).argmax(-1)
    return {"mean_cosine": cos.mean().item(), "min_cosine": cos.min().item(),
            "nn_agreement": (nn_a == nn_b).float().mean().item(), "texts": len(a)}


def compare_to_exact(model: nn.Module, tokenizer, texts: list[str], *, exact: Tensor | None = None,
                     **kwargs: Any) -> dict[str, Any]:
    """Embed ``texts`` with the retrofitted model and with exact attention (the same model in
    ``"exact"`` mode, or ``exact`` embeddings given) and compare them."""
    if exact is None:
        set_mode(model, "exact")
        try:
            exact = embed(model, tokenizer, texts, **kwargs)
        finally:
            set_mode(model, "approx")
    if not retrofit_layers(model):
        raise ValueError("compare_to_exact needs a retrofitted model")
    approx = embed(model, tokenizer, texts, **kwargs)
    return {**embedding_agreement(exact, approx), "exact": exact}
