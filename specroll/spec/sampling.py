"""Sampling processors and samplers as pure tensor functions.

Every token specroll emits is drawn here (plain decoding now; draft, bonus and recovered
tokens of speculative decoding later), so target and draft always see the same
processing: temperature, then top-k, then top-p (the order transformers and vLLM use).

Conventions:
* temperature 0 means greedy (argmax); its reported log-prob is under T = 1;
* probabilities are fp32, the CDF used to invert a uniform is float64, so the sampled
  distribution equals the processed `p` up to fp32 rounding of `p` itself;
* the log-prob reported for a token is that of the processed distribution it was drawn
  from — `log_softmax(logits / T)` with the tokens outside the top-k / top-p set removed
  and the rest renormalised — which is what the learner recomputes (`rl.algo.logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Hints:
    """What a batch's settings switch on, known on the host (the engine has every
    request's parameters there): the processors skip work no row needs without reading
    a device tensor back (a GPU stream stall per check; see `engine.syncs`). Only a
    shortcut: the results are those of the checks they replace."""

    any_greedy: bool
    """Some row has temperature 0."""
    any_tempered: bool
    """Some row has a temperature other than 0 and 1 (logits are divided)."""
    any_truncated: bool
    """Some row has top-k or top-p on."""
    any_top_p: bool
    """Some row has top-p on."""

    @classmethod
    def of(cls, rows: list[tuple[float, int, float]]) -> Hints:
        """Hints of rows given as (temperature, top_k, top_p)."""
        return cls(
            any_greedy=any(t <= 0 for t, _, _ in rows),
            any_tempered=any(t > 0 and t != 1 for t, _, _ in rows),
            any_truncated=any(k > 0 or p < 1 for _, k, p in rows),
            any_top_p=any(p < 1 for _, _, p in rows),
        )


@dataclass(frozen=True)
class RowSampling:
    """The sampling settings of a batch's rows, one entry per row: what the draft and
    the verifier must process alike (`verify`, `DraftBatch`, the engine's slots)."""

    temperature: torch.Tensor
    """[B] float (0 = greedy)."""
    top_k: torch.Tensor
    """[B] int (0 = off)."""
    top_p: torch.Tensor
    """[B] float in (0, 1] (1 = off)."""
    hints: Hints | None = None
    """The same settings summarised on the host, or None (then read from the tensors)."""

    def __getitem__(self, rows) -> RowSampling:
        """The settings of `rows` (an index tensor, a slice or a mask), in that order
        (without hints: a subset may switch off what the whole batch needed)."""
        return RowSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows])

    def only(self, live: torch.Tensor) -> RowSampling:
        """These settings on the rows of `live` ([B] bool), plain sampling at T = 1
        elsewhere: a padding row then needs no processor the live rows' hints leave out
        (a step padded to a static batch, `engine.graphs`)."""
        return RowSampling(
            torch.where(live, self.temperature, 1.0),
            torch.where(live, self.top_k, 0),
            torch.where(live, self.top_p, 1.0),
            self.hints,
        )

    def any_greedy(self) -> bool:
        """Whether some row takes the argmax (from the hints when there are any)."""
        return self.hints.any_greedy if self.hints else bool(self.greedy.any())

    @property
    def greedy(self) -> torch.Tensor:
        """[B] bool: rows that take the argmax."""
        return self.temperature <= 0

    @classmethod
    def full(
        cls,
        n: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> RowSampling:
        """n rows with the same settings, on `device`."""
        return cls(
            torch.full((n,), float(temperature), device=device),
            torch.full((n,), int(top_k), dtype=torch.long, device=device),
            torch.full((n,), float(top_p), device=device),
            Hints.of([(float(temperature), int(top_k), float(top_p))]),
        )


def temper(
    logits: torch.Tensor, temperature: torch.Tensor, hints: Hints | None = None
) -> torch.Tensor:
    """fp32 logits / T per row (T = 1 for greedy rows); no copy when every T is 1.

    logits: [B, V] or [B, n, V]; temperature: [B].
    """
    x = logits.float()
    if hints is not None and not hints.any_tempered:
        return x
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    if hints is None and bool((t == 1).all()):
        return x
    return x / t.view(-1, *[1] * (x.dim() - 1))


def truncate(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, hints: Hints | None = None
) -> torch.Tensor:
    """Top-k then top-p per row on tempered logits; excluded tokens get -inf.

    x: [B, V] or [B, n, V]; top_k: [B] int (0 = off); top_p: [B] in (0, 1] (1 = off).
    Returns `x` itself when neither is active in any row.

    Each row is processed as if it were alone: a row whose top-k / top-p is off keeps
    every token even when a batch-mate's setting makes the batch take the masking path.
    (Without that, a top_p = 1 row would run `before < 1` and lose its far tail, whose
    fp32 "mass before" rounds to exactly 1.0; a request's distribution would then depend
    on who shares its batch.) Ties are ordered by token id (stable sort), so the kept set
    is a function of the row alone.
    """
    V = x.shape[-1]
    per_row = (-1, *[1] * (x.dim() - 1))  # [B] -> broadcastable over [B, (n,) V]
    if hints is not None and not hints.any_truncated:
        return x
    k_on = (top_k > 0) & (top_k < V)  # [B]
    p_on = top_p < 1  # [B]
    if hints is None and not bool((k_on | p_on).any()):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [..., V]
    rank = torch.arange(V, device=x.device)  # [V]
    keep = ~k_on.view(per_row) | (rank < top_k.view(per_row))  # [B, (1,) V], sorted order
    keep = keep.expand_as(sorted_x).clone()  # [..., V]
    if hints.any_top_p if hints is not None else bool(p_on.any()):
        probs = sorted_x.masked_fill(~keep, NEG_INF).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        keep = keep & (~p_on.view(per_row) | (before < top_p.float().view(per_row)))
    keep[..., 0] = True  # the most likely token always survives
    mask = torch.zeros_like(keep).scatter(-1, order, keep)
    return x.masked_fill(~mask, NEG_INF)


def processed_logits(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """Apply temperature, top-k and top-p per row; excluded tokens get -inf.

    logits: [B, V] (or [B, n, V], settings broadcast over n); greedy rows are treated as
    T = 1 here (callers take the argmax). Returns fp32 logits of the same shape.
    """
    return truncate(temper(logits, s.temperature, s.hints), s.top_k, s.top_p, s.hints)


def probs_from_logits(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """Processed fp32 distribution ([..., V]) the sampler draws from."""
    return processed_logits(logits, s).softmax(dim=-1)


CDF_BLOCK = 256
"""Tokens per block of the two-level CDF inversion in `sample_from_probs`."""


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Invert float64 uniforms `u` ([B]) through the CDF of `probs` ([B, V]) → ids [B].

    The CDF is accumulated in float64 and scaled by its own total, so rounding of the
    fp32 probabilities never pushes a draw past the last token or onto a zero-mass one.
    It is inverted in two levels: the block of `CDF_BLOCK` tokens from the cumulative
    block masses, then the token within that one block. A full-vocabulary float64
    cumsum is a sequential pass that cost 4 ms a step at batch 32 on SmolLM2's 49k
    vocabulary (more than the LM head); the two levels read the vocabulary once, in a
    vectorised reduction. The result is the same inverse CDF up to float64 rounding of
    the running sums (the order they are added in), and a token of zero mass is never
    drawn: within a block the running sum only rises at tokens with mass, and a target
    that rounding leaves past a block's last running sum takes its last token with mass.
    """
    B, V = probs.shape
    W = CDF_BLOCK
    nb = -(-V // W)
    blocks = probs if nb * W == V else torch.nn.functional.pad(probs, (0, nb * W - V))
    blocks = blocks.view(B, nb, W)  # [B, nb, W]
    cum = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, nb] running block mass
    target = u * cum[:, -1]  # [B]
    j = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=nb - 1)
    rows = torch.arange(B, device=probs.device)
    start = torch.where(j > 0, cum[rows, (j - 1).clamp(min=0)], torch.zeros_like(target))
    block = blocks[rows, j]  # [B, W]
    local = block.double().cumsum(-1) + start.unsqueeze(1)  # [B, W] running mass
    i = torch.searchsorted(local, target.unsqueeze(1), right=True).squeeze(1)
    last_with_mass = W - 1 - (block.flip(-1) > 0).int().argmax(-1)  # [B]
    i = torch.where(i < W, i, last_with_mass)
    return (j * W + i).clamp_(max=V - 1)


def sample(
    logits: torch.Tensor, s: RowSampling, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return (ids [B], log-probs [B]).

    logits: [B, V]; u: [B] float64 uniforms. Greedy rows (temperature 0) take the argmax.
    """
    probs = probs_from_logits(logits, s)
    ids = sample_from_probs(probs, u)
    if s.any_greedy():
        ids = torch.where(s.greedy, logits.argmax(dim=-1), ids)
    return ids, token_logprobs(logits, s.temperature, ids, s.hints, s)


def token_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    ids: torch.Tensor,
    hints: Hints | None = None,
    s: RowSampling | None = None,
) -> torch.Tensor:
    """log_softmax(logits / T)[ids] in fp32 (T = 1 for greedy rows), of the distribution
    truncated by `s`'s top-k / top-p when given.

    logits: [B, V] or [B, n, V]; ids: [B] or [B, n]. Computed as x[id] − logsumexp(x),
    which never materialises the full log-softmax.
    """
    x = temper(logits, temperature, hints)
    if s is not None:
        x = truncate(x, s.top_k, s.top_p, hints)
    return x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - x.logsumexp(dim=-1)
