"""The package graph points one way, so that a second engine, a device layer or a sharded
learner can be added on one seam without touching the layers below it.

    model <- spec <- drafters (proposers) <- engine <- drafting (data, training, eval) <- rl <- cli

`tasks`, `sim`, `progress`, `device`, `outputs` and `inputs` are leaves: they import nothing of the
project, and any layer may import them. `sim` (the cost model and the cluster simulator)
also imports neither torch nor rich nor matplotlib, so it can run where the runtime cannot
be installed.

Below the layers, the files themselves import one way: the graph of imports between modules,
counting every import statement (top level, function-local and `if TYPE_CHECKING:`), has no
cycle. Lazy imports count, so none can exist only to dodge a cycle.

`python tests/test_layers.py --graph` prints the package graph as one JSON line.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import specroll

ROOT = Path(specroll.__file__).parent
RANK = {"model": 0, "spec": 1, "drafters": 2, "engine": 3, "drafting": 4, "rl": 5, "cli": 6}
LEAVES = {"tasks", "sim", "progress", "device", "outputs", "inputs"}
SIM_FORBIDDEN = ("torch", "rich", "matplotlib")
"""What `sim` may not import, at any level of any of its files."""


def layer(module: str) -> str:
    """specroll.engine.depth -> engine; specroll.cli -> cli."""
    return module.split(".")[1]


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute `specroll.*` import in a file, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n.startswith("specroll.")]
    return out


def test_imports_follow_the_layer_order():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        if rel.parent == Path("specroll") and rel.stem == "__init__":
            continue
        src = layer(".".join(rel.with_suffix("").parts))
        assert src in RANK or src in LEAVES, f"{rel}: package {src!r} has no place in RANK"
        for line, module in project_imports(path):
            dst = layer(module)
            ok = dst == src or (src not in LEAVES and (dst in LEAVES or RANK[dst] <= RANK[src]))
            if not ok:
                bad.append(f"{rel}:{line} ({src}) imports {module} ({dst})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_sim_imports_without_torch_rich_or_matplotlib():
    """Statically: no file of `sim` imports them, even lazily. At run time: every `sim`
    module imports, and a preset simulates, with the three blocked."""
    static = [
        f"{e.path.relative_to(ROOT.parent)}:{e.line} imports {e.target} ({e.kind})"
        for e in _imports(ROOT / "sim", "specroll.sim", external=True)
        if e.target.split(".")[0] in SIM_FORBIDDEN
    ]
    assert not static, "sim imports what it must not:\n" + "\n".join(static)
    code = (
        "import sys\n"
        f"BLOCKED = {SIM_FORBIDDEN!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'{name} is not installed here', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pkgutil, importlib, specroll.sim\n"
        "for m in pkgutil.walk_packages(specroll.sim.__path__, 'specroll.sim.'):\n"
        "    importlib.import_module(m.name)\n"
        "from specroll.sim.presets import paper_8b\n"
        "assert paper_8b('zero').run()['gen_speedup'] > 1\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in BLOCKED]\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# --------------------------------------------------------------------- file-level cycles


@dataclass(frozen=True)
class Edge:
    """One import statement's dependency of module `source` on module `target`."""

    source: str
    target: str
    path: Path
    line: int
    kind: str
    """'top' (runs at import), 'lazy' (inside a function) or 'TYPE_CHECKING'."""

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root.parent)}:{self.line}"


def module_name(path: Path, root: Path, package: str) -> str:
    """root/a/b.py -> package.a.b; root/a/__init__.py -> package.a."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module):
    """(node, kind) of every import statement of a module, with where it runs."""

    def visit(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, kind
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from visit(child, "lazy" if kind == "top" else kind)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "TYPE_CHECKING")
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from visit(child, kind)

    yield from visit(tree, "top")


def _imports(root: Path, package: str, external: bool = False) -> list[Edge]:
    """Every import statement of the package at `root` (its directory, named `package`) as
    edges between its modules: `from P.a import b` is an edge to P.a.b when that is a
    module, else to P.a; `import P.a.b` to P.a.b; relative imports alike. With `external`,
    imports of other packages too (target: the name as written)."""
    files = {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}

    def known(name: str) -> str | None:
        """The module `name`, or its longest prefix that is one (None: not ours)."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges = []
    for src, path in files.items():
        here = src if path.name == "__init__.py" else src.rpartition(".")[0]
        for node, kind in _statements(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = here.split(".")
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join([*pkg, base] if base else pkg)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in files else base)
            for t in dict.fromkeys(targets):  # once per statement and module
                mod = known(t) if t == package or t.startswith(package + ".") else None
                if mod is not None and mod != src:
                    edges.append(Edge(src, mod, path, node.lineno, kind))
                elif mod is None and external:
                    edges.append(Edge(src, t, path, node.lineno, kind))
    return edges


def _components(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.source].append(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(succ[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


@dataclass
class Cycles:
    """The import cycles of a package: each a strongly connected component of its module
    graph, with the import statements inside it."""

    root: Path
    components: list[list[str]]
    edges: list[list[Edge]]

    def __bool__(self) -> bool:
        return bool(self.components)

    def report(self) -> str:
        lines = [f"{len(self.components)} import cycle(s) between modules of {self.root}:"]
        for comp, edges in zip(self.components, self.edges, strict=True):
            lines.append(f"  cycle through {len(comp)} modules: {', '.join(comp)}")
            lines += [
                f"    {e.where(self.root)}: {e.source} -> {e.target} ({e.kind})" for e in edges
            ]
        return "\n".join(lines)


def find_cycles(root: Path, package: str | None = None) -> Cycles:
    """The import cycles of the package whose directory is `root` (named after it unless
    `package` is given), counting every import statement, lazy ones included."""
    package = package or root.name
    edges = _imports(root, package)
    nodes = sorted({module_name(p, root, package) for p in root.rglob("*.py")})
    comps = _components(nodes, edges)
    inside = [[e for e in edges if e.source in c and e.target in c] for c in comps]
    return Cycles(root, comps, inside)


def test_no_import_cycles_between_modules():
    cycles = find_cycles(ROOT)
    if cycles:
        pytest.fail(cycles.report(), pytrace=False)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_cycle_check_finds_cycles(tmp_path):
    """A synthetic package: a cycle closed by a function-local import, one under
    TYPE_CHECKING, one through relative imports; `from pkg.sub import mod` is an edge to
    the module, not to the package's __init__ (which would make a false cycle here)."""
    root = tmp_path / "pkg"
    _write(
        root,
        {
            "__init__.py": "",
            "a.py": "import pkg.b\n",
            "b.py": "def f():\n    from pkg import a\n    return a\n",
            "sub/__init__.py": "from pkg.sub.mod import X\n",
            "sub/mod.py": "X = 1\n",
            "sub/user.py": "from pkg.sub import mod\n",  # -> pkg.sub.mod, no cycle
            "c.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.d import D\n",
            "d.py": "from pkg.c import *\nclass D: ...\n",
            "r/__init__.py": "",
            "r/x.py": "from . import y\n",
            "r/y.py": "class C:\n    def m(self):\n        from .x import z\n",
            "clean.py": "import json\nfrom pkg.sub import mod\nfrom pkg import clean\n",
        },
    )
    cycles = find_cycles(root)
    assert cycles.components == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.r.x", "pkg.r.y"]]
    kinds = {(e.source, e.target): (e.kind, e.line) for es in cycles.edges for e in es}
    assert kinds == {
        ("pkg.a", "pkg.b"): ("top", 1),
        ("pkg.b", "pkg.a"): ("lazy", 2),
        ("pkg.c", "pkg.d"): ("TYPE_CHECKING", 3),
        ("pkg.d", "pkg.c"): ("top", 1),
        ("pkg.r.x", "pkg.r.y"): ("top", 1),
        ("pkg.r.y", "pkg.r.x"): ("lazy", 3),
    }
    report = cycles.report()
    assert "pkg/b.py:2: pkg.b -> pkg.a (lazy)" in report and report.startswith("3 import cycle")
    # and with the cycles broken, nothing is reported
    for rel in ("b.py", "d.py", "r/y.py"):
        (root / rel).write_text("")
    assert not find_cycles(root) and find_cycles(root).components == []


# --------------------------------------------------------------------- the graph, as JSON


def graph(root: Path = ROOT) -> dict:
    """Per package (each directory, sub-packages separately): files, lines and the other
    packages it imports; totals of files, lines and module-to-module edges; the cycles."""
    package = root.name
    edges = _imports(root, package)
    files = sorted(root.rglob("*.py"))
    pkg_of = {}
    packages: dict[str, dict] = {}
    for p in files:
        name = ".".join((package, *p.parent.relative_to(root).parts))
        pkg_of[module_name(p, root, package)] = name
        d = packages.setdefault(name, {"files": 0, "lines": 0, "imports": set()})
        d["files"] += 1
        d["lines"] += len(p.read_text().splitlines())
    for e in edges:
        a, b = pkg_of[e.source], pkg_of[e.target]
        if a != b:
            packages[a]["imports"].add(b)
    for d in packages.values():
        d["imports"] = sorted(d["imports"])
    return {
        "packages": packages,
        "files": len(files),
        "lines": sum(d["lines"] for d in packages.values()),
        "module_edges": len({(e.source, e.target) for e in edges}),
        "import_statements": len({(e.path, e.line) for e in edges}),
        "cycles": find_cycles(root).components,
    }


if __name__ == "__main__":
    if sys.argv[1:] != ["--graph"]:
        sys.exit("usage: python tests/test_layers.py --graph")
    print(json.dumps(graph(), sort_keys=False))
