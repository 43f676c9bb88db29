"""hybrid's selection on a long non-causal encoder: all-MiniLM-L6-v2 with its position table
stretched to N tokens, the default (beam descent) against scoring every leaf.

    python benchmarks/minilm_stretched.py --n 4096 16384 --out benchmarks/results

MiniLM was trained on 512 positions; its learned position embeddings are linearly interpolated to
N (a stand-in for a long encoder: the model's attention stays sharp and content-driven, which is
what selection must find). Text: torch's docstrings (``subquad.compare.smollm.long_text``, the
``eval`` part; not the standard library's). Q, K, V are captured per layer; the error is
``|out - exact|_F / |exact|_F`` against float64 exact attention per layer over all heads, then the
mean over the 6 layers. Rows: hybrid's defaults and ``candidates = 2**20`` (every leaf scored,
quadratic), at budgets 64 and 128.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import subquad
from subquad.compare.common import md_table, source_state
from subquad.compare.fidelity import exact_reference, relative_error
from subquad.compare.minilm import self_attentions
from subquad.pretrained import load_minilm
from subquad.compare.smollm import long_text

EVERY_LEAF = 1 << 20
ROWS = [("hybrid (budget 64, defaults)", {"budget": 64}),
        ("hybrid (budget 64, every leaf scored)", {"budget": 64, "candidates": EVERY_LEAF}),
        ("hybrid (budget 128, defaults)", {"budget": 128}),
        ("hybrid (budget 128, every leaf scored)", {"budget": 128, "candidates": EVERY_LEAF})]


def stretched_capture(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(q, k, v)`` ``(1, 12, n, 32)`` float32 of MiniLM with ``n`` positions."""
    tokenizer, model = load_minilm()
    table = model.embeddings.position_embeddings.weight.data  # (512, C)
    wide = F.interpolate(table.T[None], size=n, mode="linear", align_corners=True)[0].T.contiguous()
    model.embeddings.position_embeddings = torch.nn.Embedding.from_pretrained(wide, freeze=True)
    model.embeddings.register_buffer("position_ids", torch.arange(n)[None], persistent=False)
    model.embeddings.register_buffer("token_type_ids", torch.zeros(1, n, dtype=torch.long), persistent=False)
    model.config.max_position_embeddings = n
    ids = tokenizer(long_text(n, tokenizer, "eval"), return_tensors="pt")["input_ids"][:, :n]
    heads = model.config.num_attention_heads
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def keep(i, name):
        def hook(module, args, out):
            seen[i, name] = out.detach().view(1, n, heads, -1).transpose(1, 2).float()
        return hook

    handles = [getattr(attn, name).register_forward_hook(keep(i, name))
               for i, attn in enumerate(self_attentions(model)) for name in ("query", "key", "value")]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in handles:
            h.remove()
    return [(seen[i, "query"], seen[i, "key"], seen[i, "value"]) for i in range(len(handles) // 3)]


def measure(n: int) -> dict[str, list[float]]:
    layers = stretched_capture(n)
    out: dict[str, list[float]] = {label: [] for label, _ in ROWS}
    for i, (q, k, v) in enumerate(layers):
        ref = exact_reference(q, k, v)
        for label, opts in ROWS:
            out[label].append(relative_error(subquad.attention(q, k, v, method="hybrid", **opts), ref))
            print(f"N={n} layer {i}: {label}: {out[label][-1]:.4f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    start = time.time()
    res = {str(n): measure(n) for n in args.n}
    command = f"python benchmarks/minilm_stretched.py --n {' '.join(map(str, args.n))} --out {args.out}"
    rows = [[label] + [f"{sum(res[str(n)][label]) / len(res[str(n)][label]):.3f}" for n in args.n]
            for label, _ in ROWS]
    md = ["# hybrid on a long encoder: all-MiniLM-L6-v2 stretched to N tokens (non-causal)", "",
          __doc__.split("\n\n", 2)[2].strip(), "",
          f"Command: `{command}`; {source_state(Path(__file__).parent)}; torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, {time.time() - start:.0f} s.", "",
          md_table(["mean error over 6 layers"] + [f"N = {n}" for n in args.n], rows), "",
          "Per-layer errors are in the JSON next to this file."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "minilm_stretched.json").write_text(json.dumps({"command": command, "errors": res}, indent=1))
    (args.out / "minilm_stretched.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
