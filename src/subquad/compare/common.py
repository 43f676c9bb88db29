"""What every ``subquad compare`` run shares: its configuration, the machine it ran on, the
progress bar, the inputs per length, number formatting and tables, and the renderers that
turn a results document into console text, report.md and plots.

The result modules (:mod:`.compare`, :mod:`.source_minilm`, :mod:`.source_smollm`, :mod:`.peers`)
import from here and from nothing of each other (what two of them share lives here: :func:`attention_methods`,
:func:`method_errors`); :mod:`.report` and :mod:`.plots` import none of them: each result module
hands its :class:`Renderer` over (and registers it, for callers that pass none).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

import subquad

from .fidelity import exact_reference, head_errors
from .workload import forward_call, make_qkv

__all__ = ["Config", "exact_method", "is_exact", "machine_info", "machine_load", "source_state", "progress_bar",
           "random_inputs", "attention_methods", "comparison_rows", "method_errors", "error_inputs_label", "Renderer",
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
    # captured Q, K, V; subquad.compare.compare.run then needs them measured, its real_errors)
    error_inputs: str = "iid"
    text: str | None = None
    peers: bool = False
    # --source smollm / minilm: every method with a budget (registry ``budget_options``) also at these
    # shares of the N keys, the same exact keys a query for every one of them
    budgets: list[float] = field(default_factory=list)
    # --sweep: ``[method, option, [values]]``, a row of the method at each value of the option
    sweeps: list[list[Any]] = field(default_factory=list)
    # --perplexity (--source smollm): each row also as SmolLM2's attention, perplexity and time
    perplexity: bool = False
    # with perplexity: time each row's forward as the median of this many interleaved rounds
    rounds: int = 0
    # run each method's tests against its naive reference before timing it (subquad.compare.gate)
    gate: bool = True
    # --limits (--source smollm, minilm, synthetic): the reference rows of subquad.compare.limits
    limits: bool = False
    # --source smollm: the captured layers (None: subquad.data.smollm.default_layers())
    layers: list[int] | None = None
    # --source synthetic: the input families and the seeds each is drawn with
    families: list[str] = field(default_factory=list)
    seeds: int = 1
    # the random-input timing run: attention with causal=True (exact attention: SDPA's causal kernel)
    causal: bool = False
    # beside each method, the same method through torch.compile (a "METHOD compiled" row)
    compile: bool = False
    # this many neighbour processes keep a core busy while the points are measured
    busy: int = 0
    # --objective decode: single-token steps timed after a prefill of N tokens
    decode_steps: int = 32
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


def exact_method() -> str:
    """The registered exact attention (its entry's ``exact``): the baseline every method is
    measured against."""
    return next(m.name for m in subquad.list_methods() if m.exact)


def is_exact(name: str) -> bool:
    """Whether ``name`` (a method in a results document) is registered as exact attention."""
    return any(m.name == name and m.exact for m in subquad.list_methods())


def machine_load() -> dict[str, float] | None:
    """The 1-minute load average and the CPU count (None where the OS has no load average): a
    load above the cores not used by this run means another process competed for them."""
    try:
        return {"load_1min": os.getloadavg()[0], "cores": os.cpu_count() or 1}
    except (OSError, AttributeError):
        return None


def source_state(where: Path) -> str:
    """The commit of the git checkout holding ``where``, and the files under its ``src/`` that
    differ from it (a benchmark measures the working tree): ``"commit abc1234 with uncommitted
    changes to src/..."``, or ``"commit unknown"`` outside a checkout."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True).stdout
        except OSError:
            return ""
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    top = git("rev-parse", "--show-toplevel").strip()
    dirty = [line[3:] for line in git("-C", top, "status", "--porcelain", "--", "src").splitlines()] if top else []
    return f"commit {head}" + (f" with uncommitted changes to {', '.join(dirty)}" if dirty else "")


class _Lines:
    """A stand-in for tqdm when it is not installed: one line per point on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc = total, 0, desc

    def set_postfix_str(self, text: str) -> None:
        print(f"[{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, k: int = 1) -> None:
        self.done += k

    def write(self, text: str, file=None) -> None:
        print(text, file=file or sys.stderr, flush=True)

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
    float64, causal with ``config.causal`` (announced on ``bar`` while it is computed; None when
    not ``reference``)."""
    for n in sorted(config.ns):
        q, k, v = make_qkv(config.batch, config.heads, n, config.dim, dtype=dtype, device=device,
                           seed=config.seed + n)
        if reference:
            bar.set_postfix_str(f"N={n}: exact float64 reference")
        reference_out = exact_reference(q, k, v, causal=config.causal) if reference else None
        yield n, q, k, v, reference_out
        del reference_out


def attention_methods(config: Config, causal: bool = False) -> tuple[list, list[str]]:
    """The attention methods of ``config`` (``causal``: only those that support ``causal=True``)
    and a note for each one left out (token mixers have no q, k, v)."""
    infos = [subquad.get_method(m) for m in config.methods]
    notes = [f"{i.name}: a token mixer with no q, k, v; not measured here." for i in infos if i.kind != "attention"]
    if causal:
        notes += [f"{i.name}: not causal; not measured here." for i in infos if i.kind == "attention" and not i.causal]
    return [i for i in infos if i.kind == "attention" and (i.causal or not causal)], notes


def comparison_rows(attention: list, config: Config, n: int) -> list[tuple[str, Any, dict[str, Any]]]:
    """``(label, info, options)``: each method with the options of ``config``; each method with a
    budget (its registry entry's ``budget_options``) at every share ``f`` of ``config.budgets``:
    ``round(f n)`` exact keys a query, labelled ``"hybrid @ 5%"``; and each ``config.sweeps``
    entry ``[method, option, values]`` at every value, labelled ``"xattention threshold=0.8"``.
    Options a method cannot take (a budget below its fixed blocks) are the ValueError instead,
    which :func:`method_errors` reports as the row's failure."""
    rows = [(info.name, info, dict(config.options.get(info.name, {}))) for info in attention]
    by_name = {info.name: info for info in attention}

    def row(label: str, info, extra: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        user = dict(config.options.get(info.name, {}))
        try:
            options = {**user, **extra(user)}
            info.make_options(**options)
        except ValueError as e:
            options = e
        rows.append((label, info, options))

    for info in attention:
        for share in config.budgets if info.budget_options else ():
            keys = max(1, round(share * n))
            row(f"{info.name} @ {100 * share:g}%", info,
                lambda user, keys=keys, info=info: info.budget_options(info.make_options(**user), keys))
    for method, option, values in config.sweeps:
        if method in by_name:
            for value in values:
                row(f"{method} {option}={value}", by_name[method], lambda user, o=option, v=value: {o: v})
    return rows


def method_errors(attention: list, inputs: list[tuple], refs: list, config: Config, bar, what: str,
                  call: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Each method's relative error on every layer's ``(q, k, v)`` (all heads) against ``refs``, with
    the options of ``config`` and the arguments ``call`` (such as ``causal``, ``scale``), stochastic
    methods seeded with ``config.seed + layer``: ``{method: {"per_layer", "per_head", "mean",
    "failure"}}``, ``mean`` over layers, ``per_head`` each layer's errors per item and head.
    ``attention``: registry entries, or ``(label, info, options)`` rows
    (:func:`comparison_rows`; options that are an exception: the row fails with it). A method that
    raises keeps the layers it finished, ``failure`` its message and a None mean; the others go on."""
    out = {}
    for row in attention:
        label, info, own = row if isinstance(row, tuple) else (row.name, row, config.options.get(row.name, {}))
        entry: dict[str, Any] = {"per_layer": [], "per_head": [], "mean": None, "failure": None}
        if isinstance(own, Exception):
            entry["failure"] = f"{type(own).__name__}: {own}"[:300]
            bar.update(len(inputs))
            out[label] = entry
            continue
        options = {**own, **(call or {})}
        try:
            for i, (qkv, ref) in enumerate(zip(inputs, refs)):
                bar.set_postfix_str(f"{label}: layer {i + 1} {what}")
                with torch.no_grad():
                    total, heads = head_errors(forward_call(info, *qkv, options, seed=config.seed + i)(), ref)
                entry["per_layer"].append(total)
                entry["per_head"].append(heads)
                bar.update(1)
            entry["mean"] = sum(entry["per_layer"]) / len(entry["per_layer"])
        except Exception as e:  # noqa: BLE001 (reported, the run goes on)
            entry["failure"] = f"{type(e).__name__}: {e}"[:300]
            bar.update(len(inputs) - len(entry["per_layer"]))
        out[label] = entry
    return out


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
                         f"(subquad.compare.compare, .source_minilm, .source_smollm or .peers) or pass its RENDERER; "
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
