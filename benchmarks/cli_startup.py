"""How long the ``subquad`` command takes to answer, from a fresh interpreter.

    python benchmarks/cli_startup.py --out benchmarks/results                     # this checkout, 7 rounds
    python benchmarks/cli_startup.py --src /tmp/old/src --label before --out DIR  # another checkout's src/

Each command runs as ``python -m subquad ARGS`` in a new process (stdout and stderr discarded);
its wall time, from start to exit, is the median over interleaved rounds (every command once per
round, in order). ``import torch`` and an empty interpreter are timed beside them: no command that
needs the method registry (which imports torch) can answer faster than ``import torch``. With
``--src``, that directory comes first on ``PYTHONPATH``, so another checkout (say, the commit
before a change) is measured by the same interpreter and packages. Results for several labels
accumulate in ``cli_startup.json``; the ``.md`` shows them side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (what, arguments of python): the answers that need no torch, then those that do
COMMANDS = [
    ("subquad --help", ["-m", "subquad", "--help"]),
    ("subquad compare --help", ["-m", "subquad", "compare", "--help"]),
    ("subquad compare --n many (usage error)", ["-m", "subquad", "compare", "--n", "many"]),
    ("subquad retrofit (usage error)", ["-m", "subquad", "retrofit"]),
    ("subquad methods", ["-m", "subquad", "methods"]),
    ("subquad methods hybrid", ["-m", "subquad", "methods", "hybrid"]),
    ("subquad train mqar --help", ["-m", "subquad", "train", "mqar", "--help"]),
    ("python -c 'import torch' (reference)", ["-c", "import torch"]),
    ("python -c pass (reference)", ["-c", "pass"]),
]


def seconds(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   check=False, timeout=600)
    return time.perf_counter() - start


def measure(rounds: int, src: str | None) -> dict[str, list[float]]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    times: dict[str, list[float]] = {what: [] for what, _ in COMMANDS}
    for _ in range(rounds):
        for what, args in COMMANDS:
            times[what].append(seconds(args, env))
    return times


def markdown(doc: dict) -> str:
    labels = list(doc["runs"])
    lines = [
        "# `subquad` command start-up",
        "",
        "Wall time of each command in a fresh process, from start to exit (stdout and stderr "
        "discarded): the median over interleaved rounds, in seconds, min..max in brackets. "
        f"Machine: {doc['machine']['cpus']} CPUs ({doc['machine']['processor'] or doc['machine']['platform']}), "
        f"Python {doc['machine']['python']}, torch {doc['machine']['torch']}.",
        "",
    ]
    for label in labels:
        run = doc["runs"][label]
        note = f", {run['note']}" if run["note"] else ""
        lines.append(f"- **{label}** ({run['date']}, {run['rounds']} rounds{note}): `{run['command']}`")
    lines += ["", "| command | " + " | ".join(f"{label} (s)" for label in labels) + " |",
              "|---|" + "---:|" * len(labels)]
    for what, _ in COMMANDS:
        cells = []
        for label in labels:
            t = doc["runs"][label]["times"].get(what)
            cells.append(f"{statistics.median(t):.2f} [{min(t):.2f}..{max(t):.2f}]" if t else "")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    lines += ["", "`subquad methods` lists the registry, which imports torch: it cannot answer faster than "
              "`import torch` on the same machine; the rows above it import no torch."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for cli_startup.md and cli_startup.json")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--src", default=None, help="a checkout's src/ to measure instead of the installed subquad")
    p.add_argument("--label", default="this checkout", help="the name of this run in the tables")
    p.add_argument("--note", default="", help="the conditions (quiet machine, busy neighbour)")
    args = p.parse_args()
    import torch

    times = measure(args.rounds, args.src)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cli_startup.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    doc["machine"] = {"cpus": os.cpu_count(), "processor": platform.processor(), "platform": platform.platform(),
                      "python": platform.python_version(), "torch": torch.__version__}
    doc["runs"][args.label] = {"times": times, "rounds": args.rounds, "note": args.note, "src": args.src,
                               "date": datetime.date.today().isoformat(),
                               "command": "python benchmarks/cli_startup.py " + shlex.join(sys.argv[1:])}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "cli_startup.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
