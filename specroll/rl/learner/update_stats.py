"""The figures of an update: per-token statistics, their extremes and their reductions.

`Learner` accumulates an update's statistics on the device as float64 sums of
per-micro-batch shares (one host read per update, not per micro-batch), reads them once,
and reduces the figures of several updates of a step to one value each. How each figure is
accumulated, which are extremes rather than means, and which must be finite for an update
to be applied is decided here, apart from the forward and backward that produce them.
"""

from __future__ import annotations

import math

import torch

GUARDED = ("policy_loss", "kl", "grad_norm", "draft_loss", "draft_grad_norm")
"""Figures of an update that must be finite for it to be applied (`NonFiniteError`)."""
EXTREMES = ("ratio_min", "ratio_max")
"""Statistics that are extremes over the update's tokens (reduced by min / max, not mean;
None when the update had no token)."""
STAT_TERMS = ("clip_low", "clip_high", "ratio", "support")
"""Per-token terms of `loss.token_objective` that `token_stats` reads under its own mask
(a dummy micro-batch's mask is empty there, rather than its terms zeroed)."""


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (FSDP's gradient norm); other tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def token_mean(x: torch.Tensor, n: float) -> torch.Tensor:
    """sum(x) / n in float64 (a micro-batch's share of a per-token statistic's mean)."""
    return x.sum().double() / n


def micro_stats(
    acc: dict[str, torch.Tensor],
    ext: torch.Tensor,
    terms: dict[str, torch.Tensor],
    ent: torch.Tensor,
    mask: torch.Tensor,
    real: bool,
    n_tokens: float,
) -> torch.Tensor:
    """Add one micro-batch's shares of the policy statistics to `acc` (clip fraction, the
    `token_stats`, KL and the TIS clip fraction when `acc` counts them) and return the
    running [max ratio, -min ratio] `ext`. real: False for a dummy, whose tokens count
    nothing in the statistics `token_stats` reads."""
    acc["clip_frac"] = acc["clip_frac"] + token_mean(terms["clipped"] * mask, n_tokens)
    seen = mask if real else torch.zeros_like(mask)  # a dummy's tokens count nothing
    ext = token_stats(acc, ext, terms, ent, seen, n_tokens)
    if "kl" in terms:
        acc["kl"] = acc["kl"] + token_mean(terms["kl"] * mask, n_tokens)
    if "tis_clip_frac" in acc:
        acc["tis_clip_frac"] = acc["tis_clip_frac"] + token_mean(terms["capped"] & mask, n_tokens)
    return ext


def token_stats(
    acc: dict[str, torch.Tensor],
    ext: torch.Tensor,
    terms: dict[str, torch.Tensor],
    ent: torch.Tensor,
    mask: torch.Tensor,
    n_tokens: float,
) -> torch.Tensor:
    """Add one micro-batch's shares of the per-token statistics to `acc` (clip fractions
    by side, entropy, mean ratio, tokens outside the processed support when `acc` counts
    them) and return the running [max ratio, -min ratio] `ext`, all on the device.

    terms: `loss.token_objective`'s; ent, mask: [B, W] entropy and the tokens to count."""
    for key, term in (("clip_frac_low", "clip_low"), ("clip_frac_high", "clip_high")):
        acc[key] = acc[key] + token_mean(terms[term] * mask, n_tokens)
    acc["entropy"] = acc["entropy"] + token_mean(ent * mask, n_tokens)
    inside = mask & terms["support"]
    ratio = terms["ratio"].double()
    acc["ratio_mean"] = acc["ratio_mean"] + token_mean(ratio * inside, n_tokens)
    if "outside_support" in acc:
        acc["outside_support"] = acc["outside_support"] + token_mean(
            mask & ~terms["support"], n_tokens
        )
    ninf = torch.full((), -math.inf, dtype=torch.float64, device=ratio.device)
    here = torch.stack(
        [torch.where(inside, ratio, ninf).max(), torch.where(inside, -ratio, ninf).max()]
    )
    return torch.maximum(ext, here)


def settle_extremes(out: dict) -> None:
    """In place, on the figures read from the device: the minimum ratio back from its
    negation (it is max-reduced), and None for an extreme of an update without tokens."""
    out["ratio_min"] = -out["ratio_min"]
    for k in EXTREMES:  # no token in the update: no extreme
        out[k] = out[k] if math.isfinite(out[k]) else None


def nonfinite(out: dict) -> list[str]:
    """The `GUARDED` figures that are not finite (the update must not be applied)."""
    return [k for k in GUARDED if not math.isfinite(out.get(k, 0.0))]


def mean_over_updates(stats: dict[str, list]) -> dict:
    """One value per figure from the updates of a step: the mean (per position for
    lists), and for `EXTREMES` the extreme (None when no update had a token)."""
    out: dict = {}
    for k, v in stats.items():  # mean over updates (per position for lists)
        if k in EXTREMES:  # the extreme over updates (None: an update without tokens)
            seen = [x for x in v if x is not None]
            out[k] = (min if k.endswith("_min") else max)(seen) if seen else None
            continue
        out[k] = (
            [sum(x) / len(v) for x in zip(*v, strict=True)]
            if isinstance(v[0], list)
            else sum(v) / len(v)
        )
    return out
