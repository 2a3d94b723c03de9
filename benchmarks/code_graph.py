"""The package's shape, for structural reviews: on top of `tests/test_layers.py --graph`
(files, lines, module edges, cycles), the files over 400 lines, the functions over 80 and
the imports of `sim/` from `engine/`.

    python benchmarks/code_graph.py [CHECKOUT]   # CHECKOUT defaults to this one

Prints a final JSON line with the figures."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

MAX_FILE, MAX_FUNC = 400, 80


def main() -> None:
    checkout = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    sys.path.insert(0, str(checkout))
    from tests.test_layers import _imports, graph  # the one import graph the tests check

    root = checkout / "specroll"
    shape = graph(root)
    big, long_funcs = [], []
    for f in sorted(root.rglob("*.py")):
        text = f.read_text()
        name = str(f.relative_to(checkout))
        if len(text.splitlines()) > MAX_FILE:
            big.append((name, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNC:
                    long_funcs.append((f"{name}:{node.name}", n))
    eng_sim = sorted(
        {
            f"{e.source} -> {e.target}"
            for e in _imports(root, "specroll")
            if e.source.startswith("specroll.engine") and e.target.startswith("specroll.sim")
        }
    )
    for n, c in sorted(big, key=lambda x: -x[1]):
        print(f"file over {MAX_FILE}: {n} ({c} lines)")
    for n, c in sorted(long_funcs, key=lambda x: -x[1]):
        print(f"function over {MAX_FUNC}: {n} ({c} lines)")
    for e in eng_sim:
        print("engine imports sim:", e)
    print(
        json.dumps(
            {
                "files": shape["files"],
                "lines": shape["lines"],
                "module_edges": shape["module_edges"],
                "cycles": len(shape["cycles"]),
                "files_over_400": len(big),
                "functions_over_80": len(long_funcs),
                "engine_imports_sim": len(eng_sim),
            }
        )
    )


if __name__ == "__main__":
    main()
