"""Simulator figures: generation speed-up over draft depth x acceptance, and the
active-batch trace of a rollout (why speculation pays in the tail)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def heatmap(grid: dict, path: Path, title: str) -> Path:
    """grid: {"k": [...], "acceptance_length": [...], "gen_speedup": [[...] per k]}."""
    ks, als, z = grid["k"], grid["acceptance_length"], grid["gen_speedup"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(als), 1.0 + 0.6 * len(ks)))
    masked = [[float("nan") if v is None else v for v in row] for row in z]
    im = ax.imshow(masked, cmap="RdYlGn", vmin=0.5, vmax=max(2.0, _max(z)), aspect="auto")
    for i, row in enumerate(z):
        for j, v in enumerate(row):
            if v is not None:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(als)), [f"{a:g}" for a in als])
    ax.set_yticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("acceptance length at k (tokens per verification)")
    ax.set_ylabel("draft depth k")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="generation speed-up vs AR")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def trace(ar: list, spec: list, path: Path, title: str) -> Path:
    """Active rows over time, AR and speculative (traces of (t, B, k))."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name, tr in (("autoregressive", ar), ("speculative", spec)):
        if tr:
            ax.step([p[0] for p in tr], [p[1] for p in tr], where="post", label=name)
    ax.set_xlabel("seconds into generation")
    ax.set_ylabel("active rows per replica")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _max(z) -> float:
    return max((v for row in z for v in row if v is not None), default=1.0)
