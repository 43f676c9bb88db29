"""Real data and the pretrained models it comes from: the inputs ``subquad compare --source minilm /
smollm``, ``subquad retrofit``, :mod:`subquad.hf` and the benchmarks measure on.

- :mod:`.pretrained`: offline loaders of all-MiniLM-L6-v2 and SmolLM2-135M-Instruct
  (:func:`load_minilm`, :func:`load_smollm`; the ``real`` extra).
- :mod:`.minilm`: MiniLM's Q, K, V of every layer and head on a text (by default
  ``default_text.txt``, shipped in this package).
- :mod:`.smollm`: SmolLM2's causal Q, K, V at up to 8192 tokens, cached on disk, and
  :func:`~subquad.data.smollm.long_text`, long English prose for it.
- :mod:`.prose`: English prose from the docstrings of installed packages, read without importing them.

What is measured on these lives in :mod:`subquad.compare`, which this package never imports
(``tests/test_layout.py`` checks). The names below load on first use (PEP 562): importing this
package imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_module

#: public name -> the submodule that defines it
_LAZY = {"load_minilm": "pretrained", "load_smollm": "pretrained"}

__all__ = ["load_minilm", "load_smollm", "pretrained", "minilm", "smollm", "prose"]

__getattr__, __dir__ = lazy_module(__name__, _LAZY, __all__, subpackages=True)

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports these
    from .pretrained import load_minilm, load_smollm  # noqa: F401
