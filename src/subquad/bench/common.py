"""What every ``subquad compare`` run shares: its configuration, the machine it ran on, the
progress bar, the inputs per length, number formatting and tables, and the renderers that
turn a results document into console text, report.md and plots.

The result modules (:mod:`.compare`, :mod:`.minilm`, :mod:`.peers`) import from here and from
nothing of each other; :mod:`.report` and :mod:`.plots` import none of them: each result module
hands its :class:`Renderer` over (and registers it, for callers that pass none).
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from .fidelity import exact_reference
from .workload import make_qkv

__all__ = ["Config", "machine_info", "progress_bar", "random_inputs", "error_inputs_label", "Renderer",
           "register_renderer", "renderer_for", "fmt_seconds", "fmt_bytes", "fmt_ratio", "fmt_error", "fmt_rate",
           "text_table", "md_table"]


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One comparison run (the parsed command line)."""

    ns: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    batch: int = 1
    heads: int = 8
    dim: int = 64
    methods: list[str] = field(default_factory=list)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "float32"
    min_run_time: float = 0.3
    max_call_seconds: float = 20.0
    memory: bool = True
    backward: bool = True
    seed: int = 0
    max_error: float | None = None
    objective: str = "forward"
    source: str = "random"
    # what the error column is measured on: "iid" (the random inputs at each N) or "real" (MiniLM's
    # captured Q, K, V; subquad.bench.compare.run then needs them measured, its real_errors)
    error_inputs: str = "iid"
    text: str | None = None
    peers: bool = False
    out: str | None = None
    command: str = ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    info = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform(terse=True),
            "cpu": _cpu_name()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


class _Lines:
    """A stand-in for tqdm when it is not installed: one line per point on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc = total, 0, desc

    def set_postfix_str(self, text: str) -> None:
        print(f"[{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, k: int = 1) -> None:
        self.done += k

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr (the ``bench`` extra), or plain lines without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Lines(total, desc)
    return tqdm(total=total, desc=desc, unit="point", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def random_inputs(config: Config, dtype: torch.dtype, device: torch.device, bar,
                  reference: bool = True) -> Iterator[tuple[int, Tensor, Tensor, Tensor, Tensor | None]]:
    """``(n, q, k, v, reference)`` for each length of ``config``, shortest first: i.i.d. N(0, 1)
    q, k, v ``(B, H, n, D)`` seeded with ``config.seed + n``, and exact attention on them in
    float64 (announced on ``bar`` while it is computed; None when not ``reference``)."""
    for n in sorted(config.ns):
        q, k, v = make_qkv(config.batch, config.heads, n, config.dim, dtype=dtype, device=device,
                           seed=config.seed + n)
        if reference:
            bar.set_postfix_str(f"N={n}: exact float64 reference")
        reference_out = exact_reference(q, k, v) if reference else None
        yield n, q, k, v, reference_out
        del reference_out


def error_inputs_label(error_inputs: dict[str, Any] | None, short: bool = False) -> str:
    """What a compare run's errors were measured on (its results' ``"error_inputs"``; None: an
    older document, i.i.d.): ``"real MiniLM activations (N = 418)"`` or ``"i.i.d. N(0, 1)
    inputs"``; ``short``: ``"MiniLM"`` or ``"i.i.d."``."""
    if error_inputs and error_inputs.get("kind") == "real":
        return "MiniLM" if short else f"real MiniLM activations (N = {error_inputs['tokens']})"
    return "i.i.d." if short else "i.i.d. N(0, 1) inputs"


# ---------------------------------------------------------------------------------------------
# renderers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Renderer:
    """How one kind of results document (its ``"kind"``) is shown.

    ``summary(res) -> str``: the console text; ``markdown(res, images) -> str``: report.md, given
    the file names of the plots next to it; ``plot(res, out) -> [paths]``: the PNG plots written
    into the folder ``out`` (called only when matplotlib is installed).
    """

    kind: str
    summary: Callable[[dict[str, Any]], str]
    markdown: Callable[[dict[str, Any], list[str]], str]
    plot: Callable[[dict[str, Any], Path], list[Path]]


_RENDERERS: dict[str, Renderer] = {}


def register_renderer(renderer: Renderer) -> Renderer:
    """Make ``renderer`` the one :func:`renderer_for` finds for its kind; returns it."""
    _RENDERERS[renderer.kind] = renderer
    return renderer


def renderer_for(res: dict[str, Any]) -> Renderer:
    """The registered renderer of a results document's kind (its module registers it when
    imported, which whoever made the document has done)."""
    kind = res.get("kind")
    if kind not in _RENDERERS:
        raise ValueError(f"no renderer for results of kind {kind!r}: import the module that makes them "
                         f"(subquad.bench.compare, .minilm or .peers) or pass its RENDERER; "
                         f"registered kinds are {sorted(_RENDERERS)}")
    return _RENDERERS[kind]


# ---------------------------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------------------------


def fmt_seconds(s: float | None) -> str:
    """Milliseconds with three significant digits."""
    if s is None:
        return "-"
    ms = s * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    return f"{ms:.3g}" if ms >= 1 else f"{ms:.3f}"


def fmt_bytes(b: int | None) -> str:
    """MiB."""
    if b is None:
        return "-"
    mib = b / 2**20
    return f"{mib:.0f}" if mib >= 100 else f"{mib:.3g}" if mib >= 0.1 else f"{mib:.2f}"


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def fmt_error(e: float | None) -> str:
    if e is None:
        return "-"
    return f"{e:.1e}" if e < 1e-3 else f"{e:.3f}" if e < 10 else f"{e:.3g}"


def fmt_rate(r: dict[str, Any]) -> str:
    if r.get("gflops") is None:
        return "-"
    text = f"{r['gflops']:.3g}"
    if r.get("matmul_fraction") is not None:
        text += f" ({100 * r['matmul_fraction']:.0f}%)"
    return text


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns aligned with spaces (first column left, others right)."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in
                         enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)
