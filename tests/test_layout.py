"""The shape of the package, checked from its source.

- The import graph has no circles and no upward arrows. Every import counts, also one inside a
  function (a lazy import is still an arrow). The layers, bottom first, are in :data:`RANK`; a
  module may import its own layer and the layers below it.
- Only ``subquad.compare``'s own modules and ``subquad.cli`` import ``subquad.compare``.
- No function in src/ is longer than 80 lines.
- No run of six or more lines (stripped, not blank, not a comment) stands twice in src/.
"""

from __future__ import annotations

import ast
import hashlib
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "subquad"

# Bottom first. ``subquad`` itself (the facade ``__init__``, which imports registry, ops and
# layers) ranks with the layers above ``layers``: ops and layers may not import it.
RANK = {
    "checks": 0,
    "_lazy": 0,  # the lazy public names of the subquad, train, hf and data packages (standard library only)
    "cli_base": 0,  # the -o NAME=VALUE grammar and command plumbing every command module shares
    "registry": 1,
    "ops": 2,
    "layers": 3,
    "subquad": 4,
    "models": 4,
    "tasks": 4,
    "distributed": 3,  # context parallelism: the ops on a sequence split over a torch.distributed group
    "train": 5,
    "data": 4,  # real data and the pretrained models' loaders (compare, hf and the benchmarks use them)
    "hf": 5,
    "compare": 6,  # above hf: --perplexity runs a retrofitted model
    "cli": 7,
    "methods_cli": 7,
    "__main__": 8,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every subquad module ``name`` imports, anywhere in its file, resolved to a module of
    :data:`MODULES` (``from a import b`` counts as ``a.b`` when that is a module, else ``a``)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                module = ".".join(prefix + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
            targets = [t for t in targets[:-1] if t in MODULES] or [module]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "subquad"


def test_every_module_has_a_layer():
    unranked = sorted({_layer(m) for m in MODULES} - set(RANK))
    assert not unranked, f"give these parts of the package a rank in RANK: {unranked}"


def test_no_upward_imports():
    upward = [
        f"{src} -> {dst}"
        for src, targets in GRAPH.items()
        for dst in sorted(targets)
        if src != "subquad" and RANK[_layer(dst)] > RANK[_layer(src)]
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # A package's __init__ importing its own submodules is how a package is built, not a circle:
    # leave those arrows out, and the arrows of the facade.
    graph = {
        src: {dst for dst in targets if not dst.startswith(src + ".")}
        for src, targets in GRAPH.items()
        if src != "subquad"
    }
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


#: the modules that may import ``subquad.compare``: its own, and the command that reads its parser
COMPARE_IMPORTERS = ("subquad.compare", "subquad.cli")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _compare_imports(graph: dict[str, set[str]]) -> list[str]:
    """``src -> dst`` for every import of ``subquad.compare`` from outside :data:`COMPARE_IMPORTERS`."""
    return [f"{src} -> {dst}" for src, targets in sorted(graph.items()) for dst in sorted(targets)
            if _within(dst, "subquad.compare") and not any(_within(src, p) for p in COMPARE_IMPORTERS)]


def test_only_compare_and_the_cli_import_compare():
    """``subquad.compare`` is the engine of one command: what it measures on (real data, the model
    loaders) lives in ``subquad.data``, and no other part of the package reaches into it."""
    toy = {"subquad.hf.lm": {"subquad.compare.fidelity"}, "subquad.compare.cli": {"subquad.compare.common"},
           "subquad.cli": {"subquad.compare.cli"}}
    assert _compare_imports(toy) == ["subquad.hf.lm -> subquad.compare.fidelity"]
    found = _compare_imports(GRAPH)
    assert not found, "imports of subquad.compare from outside it and subquad.cli:\n" + "\n".join(found)


def _functions():
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                yield f"{path.relative_to(SRC)}:{node.lineno} {node.name}", node.end_lineno - first + 1


def test_no_function_over_80_lines():
    long = [f"{where} ({n} lines)" for where, n in _functions() if n > 80]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def _significant_lines(path: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if text and not text.startswith("#"):
            out.append((number, text))
    return out


def _is_thin(window: list[str]) -> bool:
    """A run made mostly of closing brackets, bare keywords or imports says nothing."""
    thin = sum(1 for t in window if len(t) <= 3 or t.startswith(("import ", "from ")))
    return thin * 2 > len(window)


def duplicated_runs(paths, size: int = 6) -> list[str]:
    """Runs of ``size`` significant lines that stand in two places or more: one row per set of
    files (the first such run), so a long duplicated block is one row."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        lines = _significant_lines(path)
        for i in range(len(lines) - size + 1):
            window = [t for _, t in lines[i : i + size]]
            if _is_thin(window):
                continue
            key = hashlib.sha1("\n".join(window).encode()).hexdigest()
            seen[key].append(f"{path.relative_to(SRC)}:{lines[i][0]}")
    rows, reported = [], set()
    for places in seen.values():
        if len(places) > 1:
            files = tuple(sorted({p.rsplit(":", 1)[0] for p in places}))
            if files not in reported:
                reported.add(files)
                rows.append(" ~ ".join(places))
    return rows


def test_duplicate_finder_finds_a_duplicate(tmp_path):
    block = "\n".join(f"value_{i} = compute({i}, weight)" for i in range(6))
    (tmp_path / "subquad").mkdir()
    a, b = tmp_path / "subquad" / "a.py", tmp_path / "subquad" / "b.py"
    a.write_text(f"x = 1\n{block}\n")
    b.write_text(f"{block}\ny = 2\n")
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        assert duplicated_runs([a, b]) == ["subquad/a.py:2 ~ subquad/b.py:1"]
    finally:
        SRC = saved


@pytest.mark.parametrize("size", [6])
def test_no_duplicated_runs(size):
    rows = duplicated_runs(MODULES.values(), size)
    assert not rows, f"runs of {size} lines written twice:\n" + "\n".join(rows)


# Branches on a method's name that are still waiting for a registry fact. Each entry is
# "file: name"; remove it when the branch goes.
NAME_BRANCHES_ALLOWED: set[str] = set()


def _name_branches():
    """``file: name`` for every comparison (``==``, ``!=``, ``in``, ``not in``) with a string literal
    naming a registered method, and every literal list of two or more of them,
    outside that method's own folder ``ops/<name>/`` and layer module ``layers/<name>.py``."""
    import subquad

    names = {m.name for m in subquad.list_methods()}
    found = set()
    for path in MODULES.values():
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):  # a hand-kept list of methods
                listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                found.update(f"{rel}: {name}" for name in listed if len(listed) > 1)
            if not isinstance(node, ast.Compare):
                continue
            left = node.left.attr if isinstance(node.left, ast.Attribute) else getattr(node.left, "id", None)
            if left == "complexity":  # "linear" the complexity class, not the method
                continue
            for side in [node.left, *node.comparators]:
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                for e in elts:
                    if isinstance(e, ast.Constant) and e.value in names:
                        own = (f"subquad/ops/{e.value}/", f"subquad/layers/{e.value}.py")
                        if not rel.startswith(own):
                            found.add(f"{rel}: {e.value}")
    return found


def test_no_branch_on_a_method_name_outside_its_folder():
    """What code asks of a method it asks its registry entry (exact, logit_scale, causal,
    length_multiple...), not its name: a new method then needs no edits elsewhere."""
    found = _name_branches()
    assert found <= NAME_BRANCHES_ALLOWED, sorted(found - NAME_BRANCHES_ALLOWED)
    assert NAME_BRANCHES_ALLOWED <= found, f"no longer needed, remove: {sorted(NAME_BRANCHES_ALLOWED - found)}"


def test_benchmarks_use_public_names_only():
    """A benchmark script imports no private name of subquad and reads no private attribute of what
    it imported from subquad (a benchmark measures the library as users call it)."""
    found = []
    for path in sorted((SRC.parent / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("subquad"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{path.name}:{node.lineno} imports {alias.name}")
                    imported.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("subquad")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not found, "benchmarks reaching into private names:\n" + "\n".join(found)


#: what benchmarks/ may hold: the measurements no public command makes (module comparisons with
#: peer packages, the context-parallel launcher, the GPU check); everything else is `subquad compare`,
#: `subquad retrofit` or `subquad train report`
MAX_BENCHMARK_SCRIPTS = 6


def test_benchmarks_hold_few_scripts():
    scripts = sorted(p.name for p in (SRC.parent / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) <= MAX_BENCHMARK_SCRIPTS, (
        f"benchmarks/ holds {len(scripts)} scripts ({', '.join(scripts)}); a measurement that compares methods "
        "belongs in subquad compare (a sweep, a column, an option)")


def test_nothing_but_its_cli_imports_compare():
    """subquad.compare is the benchmark runner: the library, hf, train and data never import it (they
    may name it in docstrings)."""
    found = []
    for path in sorted((SRC / "subquad").rglob("*.py")):
        rel = path.relative_to(SRC / "subquad")
        if rel.parts[0] == "compare" or rel.as_posix() == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            level = getattr(node, "level", 0)
            for name in names:
                if name.startswith("subquad.compare") or (level and name.split(".")[0] == "compare"):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, "imports of subquad.compare outside it: " + ", ".join(found)
