"""The package graph points one way, so that a second engine, a device layer or a sharded
learner can be added on one seam without touching the layers below it.

    model <- spec <- drafters (proposers) <- engine <- drafting (data, training, eval) <- rl <- cli

`tasks`, `sim`, `progress` and `device` are leaves: they import nothing of the project, and any
layer may import them. `sim` (the cost model and the cluster simulator) also imports no
torch, so it can run where the runtime cannot be installed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import specroll

ROOT = Path(specroll.__file__).parent
RANK = {"model": 0, "spec": 1, "drafters": 2, "engine": 3, "drafting": 4, "rl": 5, "cli": 6}
LEAVES = {"tasks", "sim", "progress", "device"}


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


def test_sim_imports_without_torch():
    code = (
        "import builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name == 'torch' or name.startswith('torch.'):\n"
        "        raise ImportError('torch is not installed here')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import pkgutil, importlib, specroll.sim\n"
        "for m in pkgutil.iter_modules(specroll.sim.__path__):\n"
        "    importlib.import_module('specroll.sim.' + m.name)\n"
        "from specroll.sim.presets import paper_8b\n"
        "assert paper_8b('zero').run()['gen_speedup'] > 1\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
