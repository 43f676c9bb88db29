"""``subquad compare ... --base REV``: the same timing run at this checkout and at another git
revision, in separate processes, alternating, and the speed-up of this checkout over ``REV``.

The revision's ``src/`` is unpacked from git (``git archive REV src``) into a temporary folder;
each round runs ``python -m subquad compare`` with the rest of the command line twice, once with
this checkout's ``src/`` first on ``PYTHONPATH`` and once with the revision's (the order
alternates from round to round: ABBA), each into its own folder. A change's speed-up is then read
from the same machine, minutes apart, with the slow spells of a shared machine spread over both.
Per (N, method) the table gives each side's median over the rounds of its forward (and
forward+backward) time and the ratio ``base / head`` (above 1: this checkout is faster).

The correctness gate runs in the first round of each side; the memory measurement is off (a
change's memory is one run's number, not a timing's). The revision must know every option of
the command line (a flag added since then fails its runs, and the report says so).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import Renderer, fmt_ratio, fmt_seconds, md_table, register_renderer, text_table

__all__ = ["checkout_root", "unpack_revision", "run", "RENDERER"]

#: what each side's row keeps of a compare results.json
TIMES = ("forward_s", "forward_backward_s")


def checkout_root() -> Path:
    """The git checkout this subquad is imported from (``src/subquad`` inside it); ValueError when
    it is an installed copy outside one."""
    src = Path(__file__).resolve().parents[2]
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=src, capture_output=True, text=True)
    if top.returncode != 0 or not (Path(top.stdout.strip()) / "src" / "subquad").is_dir():
        raise ValueError(f"--base needs subquad run from a git checkout (src/subquad); {src} is not in one")
    return Path(top.stdout.strip())


def unpack_revision(root: Path, rev: str, into: Path) -> str:
    """``src/`` of ``rev`` unpacked under ``into``; returns the full commit hash (ValueError for a
    revision git does not know)."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=root, capture_output=True,
                            text=True)
    if commit.returncode != 0:
        raise ValueError(f"--base {rev!r}: not a revision of {root} ({commit.stderr.strip()})")
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "src.tar"
    subprocess.run(["git", "archive", "--output", str(archive), commit.stdout.strip(), "src"], cwd=root, check=True)
    with tarfile.open(archive) as tar:
        try:
            tar.extractall(into, filter="data")
        except TypeError:  # a Python without extraction filters (git's own archive: trusted)
            tar.extractall(into)
    archive.unlink()
    return commit.stdout.strip()


def _one_run(src: Path, argv: list[str], out: Path, gate: bool) -> dict[str, Any]:
    """One ``subquad compare`` in a fresh process with ``src`` first on the path; its results (or
    ``{"failure": ...}``)."""
    path = os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "subquad", "compare", *argv, "--no-memory", "--quiet", "--out", str(out)]
    if not gate:
        cmd.append("--no-gate")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not (out / "results.json").exists():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failure": f"exit {proc.returncode}: {tail}"}
    return json.loads((out / "results.json").read_text())


def _rows(results: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, list[float]]]:
    """Per (N, method), each time's values over the rounds that measured it."""
    out: dict[tuple[int, str], dict[str, list[float]]] = {}
    for res in results:
        for r in res.get("rows", []):
            entry = out.setdefault((r["n"], r["method"]), {key: [] for key in TIMES})
            for key in TIMES:
                if r.get(key) is not None:
                    entry[key].append(r[key])
    return out


def _table(head: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (N, method) measured on either side: medians and ``base / head``."""
    h, b = _rows(head), _rows(base)
    rows = []
    for key in sorted(set(h) | set(b)):
        row: dict[str, Any] = {"n": key[0], "method": key[1]}
        for t in TIMES:
            hv, bv = h.get(key, {}).get(t) or [], b.get(key, {}).get(t) or []
            row[f"head_{t}"] = statistics.median(hv) if hv else None
            row[f"base_{t}"] = statistics.median(bv) if bv else None
            row[f"speedup_{t}"] = row[f"base_{t}"] / row[f"head_{t}"] if hv and bv else None
        rows.append(row)
    return rows


def run(argv: list[str], rev: str, rounds: int, work: Path | None = None, show_progress: bool = True,
        command: str = "") -> dict[str, Any]:
    """The ``--base`` comparison: ``argv`` (compare's arguments without ``--base``, ``--rounds``,
    ``--out``) at this checkout and at ``rev``, ``rounds`` rounds each, alternating."""
    root = checkout_root()
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="subquad-base-") as tmp:
        tmp_path = Path(tmp)
        commit = unpack_revision(root, rev, tmp_path / "base")
        sides = {"head": root / "src", "base": tmp_path / "base" / "src"}
        results: dict[str, list[dict[str, Any]]] = {"head": [], "base": []}
        failures: list[str] = []
        for r in range(rounds):
            order = ("head", "base") if r % 2 == 0 else ("base", "head")
            for side in order:
                if show_progress:
                    print(f"subquad compare --base: round {r + 1}/{rounds}, {side}", file=sys.stderr, flush=True)
                res = _one_run(sides[side], argv, (work or tmp_path) / f"{side}_{r}", gate=r < 2)
                if "failure" in res:
                    failures.append(f"round {r + 1}, {side}: {res['failure']}")
                else:
                    results[side].append(res)
    head_state = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True,
                                text=True).stdout.strip()
    return {"kind": "compare_base", "command": command, "base": {"rev": rev, "commit": commit},
            "head": head_state, "rounds": rounds, "rows": _table(results["head"], results["base"]),
            "failures": failures, "machine": (results["head"] or results["base"] or [{}])[0].get("machine"),
            "seconds": time.time() - start}


def _cells(r: dict[str, Any]) -> list[str]:
    out = [str(r["n"]), r["method"]]
    for t in TIMES:
        out += [fmt_seconds(r[f"head_{t}"]), fmt_seconds(r[f"base_{t}"]), fmt_ratio(r[f"speedup_{t}"])]
    return out


HEADERS = ["N", "method", "forward ms (head)", "(base)", "base / head", "fwd+bwd ms (head)", "(base)", "base / head"]


def summary_text(res: dict[str, Any]) -> str:
    """The console table."""
    out = [f"subquad compare --base {res['base']['rev']} ({res['base']['commit'][:10]}) against {res['head']}: "
           f"medians of {res['rounds']} alternating rounds each; base / head above 1: this checkout is faster",
           text_table(HEADERS, [_cells(r) for r in res["rows"]])]
    out += [f"failed: {f}" for f in res["failures"]]
    return "\n".join(out)


def markdown(res: dict[str, Any], images: list[str]) -> str:
    """report.md."""
    m = res.get("machine") or {}
    return "\n".join([
        f"# subquad compare: this checkout ({res['head']}) against {res['base']['rev']} "
        f"({res['base']['commit'][:10]})", "",
        f"Each side ran `subquad compare` with the same arguments in a fresh process, {res['rounds']} rounds "
        "each, alternating (ABBA); the medians over the rounds, and base / head (above 1: this checkout is "
        f"faster). {m.get('cpu', '')}, {m.get('threads', '?')} threads, torch {m.get('torch', '?')}; "
        f"{res['seconds']:.0f} s.", "", f"Command: `{res['command']}`", "",
        md_table(HEADERS, [_cells(r) for r in res["rows"]]), "",
        *[f"- failed: {f}" for f in res["failures"]], ""])


#: the console text and report.md of a ``"compare_base"`` document
RENDERER = register_renderer(Renderer("compare_base", summary=summary_text, markdown=markdown,
                                      plot=lambda res, out: []))
