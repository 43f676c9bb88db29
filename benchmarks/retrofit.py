"""Retrofit all-MiniLM-L6-v2 with every subquad method: embedding agreement zero-shot and after
attention transfer, per attention budget, and the speed of retrofitted models.

    .venv/bin/python benchmarks/retrofit.py                       # everything (about half an hour on 2 cores)
    .venv/bin/python benchmarks/retrofit.py --only quality        # the cosine table and plot
    .venv/bin/python benchmarks/retrofit.py --only speed          # encoder at 512 tokens, decoder at long N
    .venv/bin/python benchmarks/retrofit.py --only encoder        # the encoder rows alone

Writes benchmarks/results/retrofit.json, retrofit.md, retrofit_cosine.png, retrofit_speed.png and the
committed artifacts retrofits/minilm-<method>.pt. Training text: docstrings of numpy, torch and
transformers; held-out text: docstrings of the Python standard library. Needs subquad[real].
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import subquad.hf as H
from subquad.data.pretrained import load_minilm
from subquad.compare.timing import median_time
from subquad.hf import texts as T

ROOT = Path(__file__).resolve().parents[1]

# (method, options, budget, steps, artifact name or None). Budget: what each query pays per key
# block: features (linear, performer, hedgehog: 2F), landmarks (nystrom, lara), block (sinkhorn),
# plus the exact window of the hedgehog hybrid; hybrid: keys attended exactly (the sink block, the
# query block's own block and its two neighbours, and num_blocks selected, of key_block keys each).
CONFIGS = [
    ("hedgehog", {"window": 64, "sinks": 1}, 64 + 64 + 1, 300, "minilm-hedgehog.pt"),
    ("hedgehog", {}, 64, 200, None),
    ("nystrom", {"num_landmarks": 64}, 64, 100, "minilm-nystrom.pt"),
    ("nystrom", {"num_landmarks": 128}, 128, 100, None),
    ("performer", {"num_features": 256}, 256, 100, "minilm-performer.pt"),
    ("linear", {}, 32, 100, "minilm-linear.pt"),
    ("efficient", {}, 32, 100, None),
    ("nystrom", {"num_landmarks": 32}, 32, 0, None),
    ("performer", {"num_features": 64}, 64, 0, None),
    ("lara", {"num_landmarks": 64}, 64, 0, None),
    ("sinkhorn", {"block_size": 64}, 64, 0, None),
    ("ra", {}, 512, 0, None),
    ("hybrid", {"query_block": 8, "key_block": 8, "num_blocks": 4}, 64, 0, None),
    ("hybrid", {"query_block": 16, "key_block": 16, "num_blocks": 4}, 128, 0, None),
    ("hybrid", {"query_block": 32, "key_block": 32, "num_blocks": 4}, 256, 0, None),
    ("hybrid", {"query_block": 32, "key_block": 32, "num_blocks": 8}, 384, 0, "minilm-hybrid.pt"),
]


def _label(method, options):
    return method + "".join(f" {k}={v}" for k, v in options.items())


def quality(args) -> dict:
    torch.manual_seed(0)
    tok, model = load_minilm()
    third, std = T.third_party_texts(), T.stdlib_paragraphs()
    train = T.pack(third, args.train_texts, words=300, seed=0)
    held = random.Random(1).sample(std, args.eval_texts)
    long_held = T.pack(std, args.long_texts, words=300, seed=2)
    H.retrofit(model, "softmax")
    t0 = time.time()
    cache = H.cache_teacher(model, train, tok, progress=False)
    cache_s = time.time() - t0
    H.set_mode(model, "exact")
    exact, exact_long = H.embed(model, tok, held), H.embed(model, tok, long_held)
    H.unretrofit(model)
    rows = []
    for method, options, budget, steps, artifact in CONFIGS:
        if args.methods and method not in args.methods:
            continue
        label = _label(method, options)
        print(f"== {label}", flush=True)
        H.retrofit(model, method, **options)
        row = {"method": method, "options": options, "budget": budget, "label": label, "steps": steps}
        try:
            row["zero_shot"] = H.embedding_agreement(exact, H.embed(model, tok, held))
            row["zero_shot_long"] = H.embedding_agreement(exact_long, H.embed(model, tok, long_held))
            if steps:
                res = H.transfer(model, train, tok, steps=steps, lr=1e-2, batch_size=args.batch_size, seed=0,
                                 cache=cache, progress=False)
                row["transfer"] = {k: res[k] for k in ("loss_before", "loss_after", "seconds", "parameters")}
                row["transfer"]["seconds_with_cache"] = res["seconds"] + cache_s
                row["after"] = H.embedding_agreement(exact, H.embed(model, tok, held))
                row["after_long"] = H.embedding_agreement(exact_long, H.embed(model, tok, long_held))
            if artifact:  # a method without trained parameters stores only its method and options
                scores = {k: row[k] for k in ("zero_shot", "zero_shot_long", "after", "after_long") if k in row}
                path = H.save_retrofit(model, ROOT / "retrofits" / artifact,
                                       meta={"options": options, "steps": steps,
                                             "train_texts": len(train) if steps else 0, **scores})
                row["artifact"] = str(path.relative_to(ROOT))
        except Exception as e:  # noqa: BLE001  (reported in the table)
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        H.unretrofit(model)
        print(json.dumps({k: v for k, v in row.items() if k in ("zero_shot", "after", "error")}), flush=True)
        rows.append(row)
    return {"model": "all-MiniLM-L6-v2", "train_texts": len(train),
            "train_tokens": sum(r["q"].shape[2] for r in cache[0]), "held_out": len(held),
            "held_out_long": len(long_held), "cache_seconds": cache_s, "rows": rows}


def encoder_speed(args) -> dict:
    """MiniLM forward at 512 tokens, each retrofit against sdpa."""
    tok, model = load_minilm()
    text = " ".join(T.stdlib_paragraphs()[:60])
    enc = tok([text] * args.speed_batch, return_tensors="pt", truncation=True, max_length=512)
    assert enc["input_ids"].shape[1] == 512
    enc_rows = []
    with torch.no_grad():
        base = median_time(lambda: model(**enc), 1.0, num_threads=1).seconds
        enc_rows.append({"method": "sdpa (exact)", "seconds": base, "ratio": 1.0})
        for method, options in [("hedgehog", {"window": 64, "sinks": 1}), ("hedgehog", {}),
                                ("nystrom", {"num_landmarks": 64}), ("performer", {"num_features": 256}),
                                ("linear", {}),
                                ("hybrid", {"query_block": 32, "key_block": 32, "num_blocks": 8})]:
            H.retrofit(model, method, **options)
            t = median_time(lambda: model(**enc), 1.0, num_threads=1).seconds
            enc_rows.append({"method": _label(method, options), "seconds": t, "ratio": base / t})
            H.unretrofit(model)
    return {"batch": args.speed_batch, "tokens": 512, "rows": enc_rows}


def speed(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    encoder = encoder_speed(args)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1 << 15)
    dec = LlamaForCausalLM(cfg).eval()
    dec_rows = []
    with torch.no_grad():
        for n in args.decoder_lengths:
            ids = torch.randint(0, 1000, (1, n))
            base = median_time(lambda ids=ids: dec.model(input_ids=ids), 0.5, num_threads=1).seconds
            dec_rows.append({"n": n, "method": "sdpa (exact, causal)", "seconds": base, "ratio": 1.0})
            for method, options in [("hedgehog", {}), ("hedgehog", {"window": 64}), ("linear", {}),
                                    ("performer", {"num_features": 128})]:
                H.retrofit(dec, method, **options)
                t = median_time(lambda ids=ids: dec.model(input_ids=ids), 0.5, num_threads=1).seconds
                dec_rows.append({"n": n, "method": _label(method, options), "seconds": t, "ratio": base / t})
                H.unretrofit(dec)
            print(json.dumps(dec_rows[-5:]), flush=True)
    return {"threads": torch.get_num_threads(), "encoder": encoder,
            "decoder": {"config": "Llama, 2 layers, hidden 256, 4 heads of 64, random init, batch 1, forward (prefill)",
                        "rows": dec_rows}}


def _fmt(x, nd=4):
    return "-" if x is None else f"{x:.{nd}f}"


def _long(r):
    return "-" if not r else f"{r['mean_cosine']:.4f} ({r['min_cosine']:.4f})"


def markdown(res: dict) -> str:
    out = ["# Retrofitting all-MiniLM-L6-v2 with subquad attention", ""]
    q = res.get("quality")
    if q:
        out += [f"Embedding agreement with the exact model on {q['held_out']} held-out standard-library docstring "
                f"paragraphs (mean-pooled sentence embeddings; cosine mean and minimum, and top-1 nearest-neighbour "
                f"agreement among the paragraphs) and the mean (minimum) cosine on {q['held_out_long']} held-out texts "
                f"of about 400 tokens ('-': not measured). Transfer: {q['train_texts']} training texts "
                f"({q['train_tokens']} tokens) of numpy, "
                f"torch and transformers docstrings; the teacher cache took {q['cache_seconds']:.0f} s and is shared "
                "by all "
                "rows; transfer time excludes it.", "",
                "| method | budget | zero-shot mean cos | zero-shot min cos | zero-shot NN agr. | transferred mean cos "
                "| transferred min cos | transferred NN agr. | long texts, mean (min): zero-shot / transferred "
                "| steps | transfer s | trained params |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in q["rows"]:
            if "error" in r and "zero_shot" not in r:
                out.append(f"| {r['label']} | {r['budget']} | FAILED: {r['error']} |" + " |" * 9)
                continue
            z, a = r["zero_shot"], r.get("after")
            zl, al = r.get("zero_shot_long"), r.get("after_long")
            tr = r.get("transfer", {})
            out.append(
                f"| {r['label']} | {r['budget']} | {_fmt(z['mean_cosine'])} | {_fmt(z['min_cosine'])} | "
                f"{_fmt(z['nn_agreement'], 3)} | {_fmt(a and a['mean_cosine'])} | {_fmt(a and a['min_cosine'])} | "
                f"{_fmt(a and a['nn_agreement'], 3)} | "
                f"{_long(zl)} / {_long(al)} | "
                f"{r['steps']} | {_fmt(tr.get('seconds'), 0)} | {tr.get('parameters', '-')} |")
    s = res.get("speed")
    if s:
        e = s["encoder"]
        out += ["", f"Encoder forward, batch {e['batch']} x {e['tokens']} tokens, {s['threads']} threads "
                "(median, torch.utils.benchmark; ratio = sdpa time / method time):", "",
                "| method | seconds | speed vs sdpa |", "|---|---|---|"]
        out += [f"| {r['method']} | {r['seconds']:.3f} | {r['ratio']:.2f}x |" for r in e["rows"]]
        d = s["decoder"]
        out += ["", f"Decoder forward: {d['config']}:", "", "| N | method | seconds | speed vs sdpa |",
                "|---|---|---|---|"]
        out += [f"| {r['n']} | {r['method']} | {r['seconds']:.3f} | {r['ratio']:.2f}x |" for r in d["rows"]]
    return "\n".join(out) + "\n"


def plot(res: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    q = res.get("quality")
    if q:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        methods = list(dict.fromkeys(r["method"] for r in q["rows"] if "zero_shot" in r))
        colors = {m: plt.cm.tab10(i) for i, m in enumerate(methods)}
        for ax, key in zip(axes, ("mean_cosine", "min_cosine")):
            for m in methods:
                rows = sorted((r for r in q["rows"] if r["method"] == m and "zero_shot" in r
                               and (m != "hedgehog" or not r["options"].get("window"))), key=lambda r: r["budget"])
                if rows:
                    ax.plot([r["budget"] for r in rows], [r["zero_shot"][key] for r in rows], "o--", color=colors[m],
                            alpha=0.6)
                    tr = [r for r in rows if r.get("after")]
                    ax.plot([r["budget"] for r in tr], [r["after"][key] for r in tr], "o-", color=colors[m], label=m)
                hy = sorted((r for r in q["rows"] if r["method"] == m and r["options"].get("window")
                             and r.get("after")), key=lambda r: r["budget"])
                if hy:
                    ax.plot([r["budget"] for r in hy], [r["after"][key] for r in hy], "s", color="black", ms=9,
                            label="hedgehog + exact window 64 + 1 sink (transferred)")
            ax.set_xscale("log", base=2)
            ax.axhline(0.99 if key == "mean_cosine" else 0.97, color="grey", lw=0.8, ls=":")
            ax.set_xlabel("attention budget per query (features, landmarks, block or window keys; log)")
            ax.set_ylabel(key.replace("_", " ") + " to the exact model")
            ax.set_ylim(max(0.0, min(ax.get_ylim()[0], 0.9)), 1.005)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8, loc="lower right")
        fig.suptitle("all-MiniLM-L6-v2 retrofits: sentence-embedding cosine to the exact model on held-out "
                     "stdlib docstrings (dashed: zero-shot, solid: after attention transfer)", fontsize=10)
        fig.tight_layout()
        p = out / "retrofit_cosine.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    s = res.get("speed")
    if s:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        rows = s["decoder"]["rows"]
        for m in dict.fromkeys(r["method"] for r in rows):
            rr = [r for r in rows if r["method"] == m]
            ax.plot([r["n"] for r in rr], [r["seconds"] for r in rr], "o-", label=m,
                    color="black" if m.startswith("sdpa") else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("forward seconds (log)")
        ax.set_title("Retrofitted decoder (random 2-layer Llama) vs sdpa", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / "retrofit_speed.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["quality", "speed", "encoder"], default=None,
                    help="encoder: only the encoder speed rows (the decoder's are kept)")
    ap.add_argument("--methods", nargs="+", default=None, help="only these methods (quality)")
    ap.add_argument("--train-texts", type=int, default=32)
    ap.add_argument("--eval-texts", type=int, default=96)
    ap.add_argument("--long-texts", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=2, help="texts per transfer step")
    ap.add_argument("--speed-batch", type=int, default=4)
    ap.add_argument("--decoder-lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "retrofit.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    if args.only in (None, "quality"):
        new = quality(args)
        if args.methods and res.get("quality"):  # merge: replace only the methods run now
            keep = [r for r in res["quality"]["rows"] if r["method"] not in args.methods]
            new["rows"] = sorted(keep + new["rows"], key=lambda r: [c[:2] for c in CONFIGS].index(
                (r["method"], r["options"])) if (r["method"], r["options"]) in [c[:2] for c in CONFIGS] else 99)
        res["quality"] = new
        path.write_text(json.dumps(res, indent=1))
    if args.only in (None, "speed"):
        res["speed"] = speed(args)
        path.write_text(json.dumps(res, indent=1))
    if args.only == "encoder" and res.get("speed"):  # the decoder rows are kept
        res["speed"]["encoder"] = encoder_speed(args)
        path.write_text(json.dumps(res, indent=1))
    (args.out / "retrofit.md").write_text(markdown(res))
    for p in plot(res, args.out):
        print("wrote", p)


if __name__ == "__main__":
    main()
