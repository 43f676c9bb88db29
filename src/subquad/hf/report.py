"""What ``subquad retrofit --report DIR`` writes: ``retrofit.json`` (every number, the command and
the machine) and ``retrofit.md`` (the command, then one table per measurement, units in the
headers), from the rows of :class:`subquad.hf.measure.Measurement`."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["build_report", "markdown", "write_report"]


def _commit() -> str:
    """The short commit of the git checkout holding this file ("unknown" outside one)."""
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def _plain(x: Any) -> Any:
    """``x`` without tensors (a decoder's greedy predictions), as JSON reads it back."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items() if not isinstance(v, torch.Tensor)}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def build_report(config: dict[str, Any], baseline: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"config", "exact", "rows"}`` as JSON reads it back (keys are strings): ``config`` gains
    the date, torch, threads, platform and commit; ``baseline`` is a decoder's exact attention
    (:meth:`~subquad.hf.measure.Measurement.decoder_baseline`; None for an encoder)."""
    config = {**config, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "platform": platform.platform(terse=True), "commit": _commit()}
    return json.loads(json.dumps(_plain({"config": config, "exact": baseline, "rows": rows})))


def write_report(directory: Path, report: dict[str, Any]) -> list[Path]:
    """``directory/retrofit.json`` and ``directory/retrofit.md``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "retrofit.json", directory / "retrofit.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(report), encoding="utf-8")
    return paths


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]


def _f(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: what was measured, on what and by which command, then the tables."""
    c = report["config"]
    lines = [f"# subquad retrofit: {c['model']} with subquad attention", "",
             f"Command: `{c['command']}`", "",
             f"{c['kind'].capitalize()}, compared with its own exact attention on {c['eval']}. subquad at commit "
             f"{c['commit']}; torch {c['torch']}, {c['platform']}, {c['threads']} threads, {c['date']}, "
             f"{c['seconds']:.0f} s.", ""]
    if c["kind"] == "encoder":
        lines += _encoder_tables(report)
    else:
        lines += _decoder_tables(report)
    lines += _speed_table(report) + _transfer_lines(report)
    return "\n".join(lines) + "\n"


def _cells(r: dict[str, Any] | None, keys: list[tuple[str, str]]) -> list[str]:
    return [_f(None if r is None else r.get(k), spec) for k, spec in keys]


def _encoder_tables(report: dict[str, Any]) -> list[str]:
    cos = [("mean_cosine", ".4f"), ("min_cosine", ".4f"), ("nn_agreement", ".3f")]
    body = [[r["label"], f"FAILED: {r['error']}"] + ["-"] * 5 if "error" in r else
            [r["label"], *_cells(r["zero_shot"], cos), *_cells(r.get("after"), cos)] for r in report["rows"]]
    return ["Sentence embeddings (mean-pooled last hidden states) against exact attention's: cosine mean and "
            "minimum over the held-out texts, and the share of texts whose nearest other text is the same "
            "(NN agr.); '-': not transferred.", "",
            *_table(["method", "zero-shot mean cos", "zero-shot min cos", "zero-shot NN agr.",
                     "transferred mean cos", "transferred min cos", "transferred NN agr."], body), ""]


def _decoder_tables(report: dict[str, Any]) -> list[str]:
    keys = [("ppl", ".3f"), ("ppl_ratio", ".4f"), ("ppl_last_quarter", ".3f"), ("last_quarter_ratio", ".4f"),
            ("same_prediction", ".1%"), ("seconds", ".1f")]
    lines = ["Next-token perplexity of the first N held-out tokens in one forward, over the window and its last "
             "quarter, with ratios to exact attention's, and the share of positions whose greedy next token is "
             "exact attention's.", ""]
    for n, exact in report["exact"]["ppl"].items():
        body = [["exact attention (the model's own)",
                 *_cells({**exact, "ppl_ratio": 1.0, "last_quarter_ratio": 1.0, "same_prediction": 1.0}, keys)]]
        for r in report["rows"]:
            if "error" in r:
                body.append([r["label"], f"FAILED: {r['error']}", *["-"] * 5])
            for key, what in (("zero_shot", "zero-shot"), ("after", f"after {r.get('transfer', {}).get('steps')} "
                                                                       "transfer steps")):
                if key in r:
                    body.append([f"{r['label']} ({what})", *_cells(r[key][n], keys)])
        lines += [f"## N = {n}", "", *_table(["attention", "perplexity", "vs exact", "last quarter", "vs exact",
                                              "same next token", "forward s"], body), ""]
    return lines + _generation_tables(report)


def _generation_tables(report: dict[str, Any]) -> list[str]:
    c, exact = report["config"], report["exact"]
    lines = []
    if exact.get("sample") is not None:
        lines += [f"Prompt {json.dumps(c['prompt'])}, greedy (`model.generate`): exact attention "
                  f"{json.dumps(exact['sample'])}", *(f"- {r['label']}: {json.dumps(r['sample'])}"
                                                        for r in report["rows"] if "sample" in r), ""]
    if exact.get("generation") is None:
        return lines
    g = [r for r in report["rows"] if "generation" in r]
    ms: Callable[[dict], str] = lambda x: _f(x["s_per_token"] and x["s_per_token"] * 1e3, ".1f")  # noqa: E731
    body = [["exact attention (the model's own)", "100.0", "100.0", "-", ms(exact["generation"])]]
    body += [[r["label"], f"{100 * r['generation']['forced_same']:.1f}", f"{100 * r['generation']['free_same']:.1f}",
              str(r["generation"]["first_difference"]), ms(r["generation"])] for r in g]
    lines += [f"## Greedy generation after {c['prompt_tokens']} prompt tokens", "",
              f"{c['new']} tokens generated after the first {c['prompt_tokens']} held-out tokens. Exact attention: "
              "transformers' DynamicCache; each method through `subquad.hf.decoding_cache`. Teacher-forced: fed "
              "exact attention's tokens (each position judged on the same history); free-running: its own "
              "(after a first difference the texts drift apart). ms / token: median, the prefill excluded.", "",
              *_table(["attention", "same token, teacher-forced %", "same token, free-running %",
                       "first difference", "ms / token"], body), "",
              f"Exact attention's continuation starts: {json.dumps(exact['generation']['text'])}", "",
              *(f"- {r['label']}'s: {json.dumps(r['generation']['text'])}" for r in g), ""]
    if exact.get("decoded"):
        body = [["exact attention (one forward)", f"{exact['decoded']['ppl']:.3f}", "1.0000"]]
        body += [[r["label"], f"{r['decoded']['ppl']:.3f}", f"{r['decoded']['ppl_ratio']:.4f}"]
                 for r in report["rows"] if "decoded" in r]
        lines += [f"## Perplexity of the prompt's last {c['ppl_tokens']} tokens, decoded one at a time", "",
                  *_table(["attention", "perplexity", "vs exact"], body), ""]
    return lines


def _speed_table(report: dict[str, Any]) -> list[str]:
    rows = [r for r in report["rows"] if "speed" in r]
    if not rows:
        return []
    per_n = report["config"]["kind"] == "decoder"
    body = [[*([n] if per_n else []), r["label"], f"{s['seconds']:.3f}", f"{s['exact_seconds']:.3f}",
             f"{s['speedup']:.2f}x"] for r in rows for n, s in (r["speed"].items() if per_n else [(None, r["speed"])])]
    what = ("the first N held-out tokens, one forward" if per_n else
            "the first 4 held-out texts as one padded batch")
    return [f"Forward seconds on {what}: medians of {report['config']['rounds']} forwards with the method, "
            "alternating with exact attention in the same layers (`scaled_dot_product_attention`); speed = exact "
            "seconds / the method's.", "",
            *_table([*(["N"] if per_n else []), "method", "seconds", "exact seconds", "speed vs exact"], body), ""]


def _cache(t: dict[str, Any]) -> str:
    if t.get("shared_cache_seconds") is None:
        return f"{t['cache_seconds']:.0f} s caching the teacher"
    return f"and {t['shared_cache_seconds']:.0f} s caching the teacher, shared by the rows"


def _transfer_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for r in report["rows"]:
        t = r.get("transfer")
        if t:
            mean = [None if not xs else sum(xs) / len(xs) for xs in (t["loss_before"], t["loss_after"])]
            lines.append(f"- {r['label']}: {t['steps']} transfer steps on {t['texts']} texts, {t['parameters']} "
                         f"parameters trained, {t['seconds']:.0f} s ({_cache(t)}"
                         f"{', resumed at step ' + str(t['resumed_from']) if t['resumed_from'] else ''}); mean "
                         f"layer loss {_f(mean[0])} before, {_f(mean[1])} after.")
    if not lines:
        return []
    c = report["config"]
    return [f"Attention transfer (`subquad.hf.transfer`): Adam, lr {c['lr']}, {c['batch_size']} texts a step, "
            f"{c['train_texts']} training texts of at most {c['train_length']} tokens ({c['train']}).", "",
            *lines, ""]
