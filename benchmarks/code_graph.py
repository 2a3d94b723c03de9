"""The package's shape, for structural reviews: files and lines, functions over 80 lines,
files over 400, file-level import edges, cycles, and imports of `sim/` from `engine/`.

    python benchmarks/code_graph.py [root]   # root defaults to this checkout

Prints a final JSON line with the figures."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

MAX_FILE, MAX_FUNC = 400, 80


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(tree: ast.Module, name: str, is_pkg: bool, known: set[str]) -> set[str]:
    """The specroll modules this file imports (at any depth: lazy imports count too)."""
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            if t in known:
                out.add(t)
            elif t.rsplit(".", 1)[0] in known and "." in t:
                out.add(t.rsplit(".", 1)[0])
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    files = sorted((root / "specroll").rglob("*.py"))
    known = {module_name(f, root) for f in files}
    graph, lines, long_funcs = {}, {}, []
    for f in files:
        text = f.read_text()
        name = module_name(f, root)
        tree = ast.parse(text)
        lines[name] = len(text.splitlines())
        graph[name] = imports(tree, name, f.name == "__init__.py", known)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNC:
                    long_funcs.append((f"{name}:{node.name}", n))
    # a package's __init__ importing its own submodules is not a cycle between files
    edges = {(a, b) for a, bs in graph.items() for b in bs if not b.startswith(a + ".")}
    acyclic = {a: {b for b in bs if (a, b) in edges} for a, bs in graph.items()}
    big = sorted(((n, c) for n, c in lines.items() if c > MAX_FILE), key=lambda x: -x[1])
    eng_sim = sorted(
        f"{a} -> {b}" for a, b in edges if a.startswith("specroll.engine") and ".sim" in b
    )
    for n, c in big:
        print(f"file over {MAX_FILE}: {n} ({c} lines)")
    for n, c in sorted(long_funcs, key=lambda x: -x[1]):
        print(f"function over {MAX_FUNC}: {n} ({c} lines)")
    cyc = cycles(acyclic)
    for c in cyc:
        print("cycle:", " <-> ".join(c))
    for e in eng_sim:
        print("engine imports sim:", e)
    print(
        json.dumps(
            {
                "files": len(files),
                "lines": sum(lines.values()),
                "edges": len(edges),
                "files_over_400": len(big),
                "functions_over_80": len(long_funcs),
                "cycles": len(cyc),
                "engine_imports_sim": len(eng_sim),
            }
        )
    )


if __name__ == "__main__":
    main()
