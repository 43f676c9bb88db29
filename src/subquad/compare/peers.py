"""subquad's methods side by side with the pip packages of other implementations.

``subquad compare --peers`` (the ``peers`` extra) runs each installed peer and the matching
subquad method on the same inputs with equal settings and reports relative error to exact
attention (float64) and forward time, with their ratios. A peer that is not installed is
skipped with a note. Pairs:

- nystrom-attention ``NystromAttention`` vs ``nystrom``: landmarks and pseudo-inverse steps from
  the nystrom options; the peer's projections are bypassed (its q/k/v projection returns the
  prepared q, k, v; its output projection is the identity; no conv residual).
- performer-pytorch ``FastAttention`` vs ``performer``: ``num_features`` random features.
- sinkhorn-transformer ``SinkhornAttention`` vs ``sinkhorn``: block size, Sinkhorn iterations and
  temperature from the sinkhorn options; the peer in its Sinkhorn mode (``non_permutative=False``;
  it always adds Gumbel noise).
- hamburger-pytorch ``Hamburger`` vs the ``hamburger`` token mixer: NMF with rank C/8 and six
  steps, time only (a token mixer approximates no attention, so there is no error to compare).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import subquad
from subquad import registry

from .common import (Config, Renderer, fmt_error, fmt_ratio, fmt_seconds, machine_info, md_table, progress_bar,
                     random_inputs, register_renderer, text_table)
from .fidelity import relative_error
from .timing import median_time
from .workload import DTYPES, forward_call, full_options, mixer_module

__all__ = ["Peer", "NYSTROM_ATTENTION", "PERFORMER_PYTORCH", "SINKHORN_TRANSFORMER", "HAMBURGER_PYTORCH", "PEERS",
           "all_peers", "run", "summary_text", "markdown_peers", "plot_peers", "RENDERER"]


@dataclass(frozen=True)
class Peer:
    """A peer package, the subquad method it is compared with, and the adapter that builds the
    peer's call on subquad's inputs with subquad's settings.

    For an attention method, ``adapter(q, k, v, options) -> (call, settings)``: ``call()`` runs the
    peer on q, k, v ``(B, H, N, D)`` and returns ``(B, H, N, Dv)``; ``options`` are the method's full
    options (defaults filled in); ``settings`` describes them for the report. For a token mixer,
    ``adapter(x, heads) -> (ours, theirs, settings)``: both sides built on ``x`` ``(B, N, C)``.
    A registry entry names its peer by import path (``MethodInfo.peer``, e.g.
    ``"subquad.compare.peers:NYSTROM_ATTENTION"``).
    """

    package: str  # pip name
    module: str  # import name
    method: str  # subquad method
    summary: str
    adapter: Callable = field(repr=False, compare=False)

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def version(self) -> str | None:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None


class _PreparedQKV(nn.Module):
    """Stands in for a peer's q/k/v projection: returns prepared ``(B, N, 3 H D)`` rows, with zero
    rows in front when the peer has padded its input there (a bias-free linear maps zeros to
    zeros)."""

    def __init__(self, qkv: torch.Tensor):
        super().__init__()
        self.qkv = qkv

    def forward(self, x):
        pad = x.shape[1] - self.qkv.shape[1]
        return F.pad(self.qkv, (0, 0, pad, 0)) if pad > 0 else self.qkv


def _heads_last(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).flatten(2)  # (B, H, N, D) -> (B, N, H D)


def _nystrom(q, k, v, options):
    from nystrom_attention import NystromAttention

    B, H, N, D = q.shape
    peer = NystromAttention(dim=H * D, dim_head=D, heads=H, num_landmarks=options["num_landmarks"],
                            pinv_iterations=options["pinv_iterations"], residual=False)
    peer.to_qkv = _PreparedQKV(torch.cat([_heads_last(t) for t in (q, k, v)], dim=-1))
    peer.to_out = nn.Identity()
    peer = peer.to(q.device, q.dtype).eval()
    dummy = torch.empty(B, N, H * D, device=q.device, dtype=q.dtype)
    settings = f"{options['num_landmarks']} landmarks, {options['pinv_iterations']} pinv steps"
    return (lambda: peer(dummy).view(B, N, H, D).transpose(1, 2)), settings


def _performer(q, k, v, options):
    from performer_pytorch import FastAttention

    peer = FastAttention(dim_heads=q.shape[-1], nb_features=options["num_features"], causal=False)
    peer = peer.to(q.device, q.dtype).eval()
    return (lambda: peer(q, k, v)), f"{options['num_features']} features"


def _sinkhorn(q, k, v, options):
    from sinkhorn_transformer.sinkhorn_transformer import SinkhornAttention

    B, H, N, D = q.shape
    b = options["block_size"]
    if N % b:
        raise ValueError(f"the peer needs N divisible by the block size {b}, got N={N}")
    peer = SinkhornAttention(bucket_size=b, dim=D, dim_heads=D, heads=H, max_seq_len=N,
                             temperature=options["tau"], non_permutative=False,
                             sinkhorn_iter=options["sinkhorn_iters"], n_top_buckets=options["top_blocks"])
    peer = peer.to(q.device, q.dtype).eval()
    settings = f"block {b}, {options['sinkhorn_iters']} Sinkhorn iterations, tau {options['tau']:g}"
    return (lambda: peer(q, k, v)), settings


def _hamburger_pair(x, heads):
    from hamburger_pytorch import Hamburger

    B, N, C = x.shape
    rank = max(1, C // 8)
    peer = Hamburger(dim=C, n=N, inner_dim=C, ratio=8, K=6).to(x.device, x.dtype).eval()
    xt = x.transpose(1, 2).contiguous()
    options = {"rank": rank, "eval_steps": 6, "train_steps": 6}
    ours = mixer_module(subquad.get_method("hamburger"), 1, C, options, dtype=x.dtype, device=x.device)
    return (lambda: ours(x)), (lambda: peer(xt)), f"NMF, one group of C={C} channels, rank {rank}, 6 steps"


NYSTROM_ATTENTION = Peer("nystrom-attention", "nystrom_attention", "nystrom", "NystromAttention (projections bypassed)",
                         _nystrom)
PERFORMER_PYTORCH = Peer("performer-pytorch", "performer_pytorch", "performer", "FastAttention", _performer)
SINKHORN_TRANSFORMER = Peer("sinkhorn-transformer", "sinkhorn_transformer", "sinkhorn",
                            "SinkhornAttention (Sinkhorn mode)", _sinkhorn)
HAMBURGER_PYTORCH = Peer("hamburger-pytorch", "hamburger_pytorch", "hamburger", "Hamburger (NMF), time only",
                         _hamburger_pair)

#: every peer, in report order: what :func:`all_peers` returns until the registry names them
PEERS = [NYSTROM_ATTENTION, PERFORMER_PYTORCH, SINKHORN_TRANSFORMER, HAMBURGER_PYTORCH]


def all_peers() -> list[Peer]:
    """The peers of the registered methods (``MethodInfo.peer``, resolved with
    :func:`subquad.registry.resolve_path`), in registration order. Falls back to :data:`PEERS`
    while the registry cannot resolve import paths or no registered method names a peer."""
    resolve = getattr(registry, "resolve_path", None)
    paths = [m.peer for m in subquad.list_methods() if getattr(m, "peer", None)]
    if resolve is None or not paths:
        return list(PEERS)
    return [resolve(path) for path in paths]


def _time(fn, min_run_time):
    with torch.no_grad():
        return median_time(fn, min_run_time).seconds


def _pair_point(peer: Peer, n: int, q, k, v, reference, config: Config) -> dict[str, Any]:
    row: dict[str, Any] = {"n": n, "peer": peer.package, "version": peer.version(), "method": peer.method,
                           "settings": None, "err_ours": None, "err_peer": None, "t_ours": None,
                           "t_peer": None, "speedup": None, "error_ratio": None, "error": None}
    info = subquad.get_method(peer.method)
    user = config.options.get(peer.method, {})
    torch.manual_seed(config.seed)  # the peers draw from torch's global generator
    if info.kind == "mixer":
        ours, theirs, row["settings"] = peer.adapter(_heads_last(q), config.heads)
    else:
        theirs, row["settings"] = peer.adapter(q, k, v, full_options(info, user))
        ours = forward_call(info, q, k, v, user, seed=config.seed)
        with torch.no_grad():
            row["err_ours"] = relative_error(ours(), reference)
            torch.manual_seed(config.seed)
            row["err_peer"] = relative_error(theirs(), reference)
        row["error_ratio"] = row["err_peer"] / row["err_ours"] if row["err_ours"] else None
    row["t_ours"] = _time(ours, config.min_run_time)
    row["t_peer"] = _time(theirs, config.min_run_time)
    row["speedup"] = row["t_peer"] / row["t_ours"]
    return row


def _active_peers(config: Config) -> tuple[list[Peer], list[str]]:
    """The peers to run (installed, with their method registered and among --methods), and a
    note for each one left out."""
    registered = {m.name for m in subquad.list_methods()}
    notes, active = [], []
    for peer in all_peers():
        if not peer.installed():
            notes.append(f"{peer.package} is not installed: skipped (pip install 'subquad[peers]').")
        elif peer.method not in registered:
            notes.append(f"{peer.package}: subquad has no method {peer.method!r}; skipped.")
        elif peer.method not in config.methods:
            notes.append(f"{peer.package}: {peer.method!r} is not among --methods; skipped.")
        else:
            active.append(peer)
    return active, notes


def run(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
    """Every installed peer against its subquad method at each N of ``config``."""
    start = time.time()
    device = torch.device(config.device)
    dtype = DTYPES[config.dtype]
    active, notes = _active_peers(config)
    rows = []
    bar = progress_bar(len(config.ns) * len(active), "subquad compare --peers", show_progress)
    try:
        for n, q, k, v, reference in random_inputs(config, dtype, device, bar):
            with torch.no_grad():
                exact = forward_call(subquad.get_method("softmax"), q, k, v, {})
                t_exact = median_time(exact, config.min_run_time)
            for peer in active:
                bar.set_postfix_str(f"N={n}: {peer.package} vs {peer.method}")
                try:
                    row = _pair_point(peer, n, q, k, v, reference, config)
                except Exception as e:  # noqa: BLE001 (reported, the run goes on)
                    row = {"n": n, "peer": peer.package, "version": peer.version(), "method": peer.method,
                           "error": f"{type(e).__name__}: {e}"[:300]}
                row["t_exact"] = t_exact.seconds
                rows.append(row)
                bar.update(1)
    finally:
        bar.close()
    return {
        "kind": "peers",
        "config": asdict(config),
        "machine": machine_info(device),
        "peers": [{"package": p.package, "version": p.version(), "method": p.method, "summary": p.summary}
                  for p in active],
        "rows": rows,
        "notes": notes,
        "seconds": time.time() - start,
    }


def _table(res):
    headers = ["N", "peer", "vs", "settings", "error: subquad", "error: peer", "ms: subquad", "ms: peer",
               "subquad speed-up", "exact ms"]
    body = []
    for r in sorted(res["rows"], key=lambda r: (r["peer"], r["n"])):
        name = f"{r['peer']} {r.get('version') or ''}".strip()
        if r.get("error"):
            body.append([str(r["n"]), name, r["method"], f"FAILED: {r['error']}", "-", "-", "-", "-", "-",
                         fmt_seconds(r.get("t_exact"))])
            continue
        body.append([str(r["n"]), name, r["method"], r["settings"], fmt_error(r["err_ours"]),
                     fmt_error(r["err_peer"]), fmt_seconds(r["t_ours"]), fmt_seconds(r["t_peer"]),
                     fmt_ratio(r["speedup"]), fmt_seconds(r.get("t_exact"))])
    return headers, body


def summary_text(res: dict[str, Any]) -> str:
    headers, body = _table(res)
    return "\n".join([text_table(headers, body), *(f"note: {n}" for n in res["notes"])])


def markdown_peers(res: dict[str, Any], images: list[str]) -> str:
    c, m = res["config"], res["machine"]
    headers, body = _table(res)
    where = m.get("gpu") or f"{m['cpu']}, {m['threads']} threads"
    out = [
        "# subquad compare --peers: subquad against other implementations", "",
        f"B={c['batch']}, H={c['heads']}, D={c['dim']}, {c['dtype']} forward on {m['device']} ({where}), "
        f"torch {m['torch']}; i.i.d. N(0, 1) inputs, the same for both sides. "
        f"The run took {res['seconds']:.0f} s.",
        "", f"Command: `{c['command']}`", "",
        "Errors are relative Frobenius errors to exact attention in float64; times are medians of "
        "`torch.utils.benchmark` in one run (min_run_time "
        f"{c['min_run_time']:g} s). **subquad speed-up** is the peer's time over subquad's (above 1: subquad "
        "is faster). The exact column is exact attention's forward time on the same inputs.", "",
        md_table(headers, body), "",
    ]
    if images:
        out += [*(f"![{Path(p).stem}]({p})" for p in images), ""]
    out += ["## Pairs", "", *(f"- {p['package']} {p['version']}: {p['summary']}, against subquad's "
                              f"`{p['method']}`." for p in res["peers"])]
    active = {p["package"] for p in res["peers"]}
    if "performer-pytorch" in active:
        out += ["- performer-pytorch adds 1e-4 to every query and key feature "
                "(`softmax_kernel(..., eps=1e-4)`), which pulls its attention toward uniform; on "
                "near-uniform random inputs that lowers its error (with eps=0 its error is close to "
                "subquad's, whose features are the unbiased FAVOR+ ones)."]
    if "sinkhorn-transformer" in active:
        out += ["- The Sinkhorn peer's sorted values are its sorted keys (in sinkhorn-transformer 0.11.4, "
                "`SinkhornAttention.forward` builds `b_v_r` from `b_k_r`), and it always adds Gumbel noise."]
    if "hamburger-pytorch" in active:
        out += ["- Hamburger: the two mixers draw different random bases and weights, so only time is "
                "compared."]
    if res["notes"]:
        out += ["", "## Notes", "", *(f"- {n}" for n in res["notes"])]
    return "\n".join(out) + "\n"


def plot_peers(res: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    from .plots import log_axis, save_figure

    rows = [r for r in res["rows"] if not r.get("error")]
    pairs = list(dict.fromkeys((r["peer"], r["method"]) for r in rows))
    if not pairs:
        return []
    fig, axes = plt.subplots(2, len(pairs), figsize=(3.9 * len(pairs) + 0.6, 7.2), squeeze=False)
    for j, (peer, method) in enumerate(pairs):
        pts = sorted((r for r in rows if r["peer"] == peer), key=lambda r: r["n"])
        ns = [r["n"] for r in pts]
        top, bottom = axes[0][j], axes[1][j]
        # subquad thick underneath, the peer dashed with hollow markers: coinciding lines stay visible
        top.plot(ns, [r["t_ours"] * 1e3 for r in pts], "o-", color="tab:blue", lw=3.5, ms=7,
                 label=f"subquad {method}")
        top.plot(ns, [r["t_peer"] * 1e3 for r in pts], "s--", color="tab:orange", lw=1.8, mfc="none", mew=1.8,
                 label=peer)
        if all(r.get("t_exact") for r in pts):
            top.plot(ns, [r["t_exact"] * 1e3 for r in pts], "-", color="black", lw=1, alpha=0.6,
                     label="exact attention")
        top.set_title(f"{peer}\nvs subquad {method}", fontsize=10)
        top.set_ylabel("forward time (ms, log)")
        errs = [r for r in pts if r.get("err_ours") is not None]
        if errs:
            bottom.plot([r["n"] for r in errs], [r["err_ours"] for r in errs], "o-", color="tab:blue", lw=3.5,
                        ms=7, label=f"subquad {method}")
            bottom.plot([r["n"] for r in errs], [r["err_peer"] for r in errs], "s--", color="tab:orange",
                        lw=1.8, mfc="none", mew=1.8, label=peer)
            log_axis(bottom, "y")
            bottom.set_ylabel("relative error vs exact (log)")
        else:
            bottom.text(0.5, 0.5, "time only:\nnot an approximation\nof attention", ha="center", va="center",
                        transform=bottom.transAxes, color="grey")
            bottom.axis("off")
        log_axis(top, "y")
        for ax in (top, bottom) if errs else (top,):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns])
            ax.minorticks_off()
            ax.grid(True, which="major", alpha=0.3)
            ax.set_xlabel("sequence length N")
        top.legend(fontsize=7)
    c = res["config"]
    fig.suptitle(f"subquad vs peer packages (B={c['batch']}, H={c['heads']}, D={c['dim']}, {c['dtype']}, "
                 f"{res['machine']['device']}; same inputs)", fontsize=11)
    return [save_figure(fig, out / "peers.png")]


#: the console table, report.md and the plot of a ``"peers"`` document
RENDERER = register_renderer(Renderer("peers", summary=summary_text, markdown=markdown_peers, plot=plot_peers))
