"""The engine's per-row state on the device, slot-indexed tensors (row b = cache slot b),
so that a decoding step is a handful of tensor ops whatever the batch size. The host's
truth about the same rows is `host` (`engine.rows.HostRows`)."""

from __future__ import annotations

import torch

from specroll.engine.request import Request, Result, SamplingParams
from specroll.engine.rows import CONTEXT, LENGTH, NONE, STOP, HostRows
from specroll.engine.step import StepOutputs
from specroll.spec.metrics import SpecStats
from specroll.spec.sampling import Hints, RowSampling
from specroll.spec.tree import TreeVerifyOutput
from specroll.spec.verify import VerifyOutput


class Slots:
    """Slot-indexed state of the rows being decoded (row b = slot b), on the engine's
    device (`device`), and their host state (`host`)."""

    def __init__(
        self,
        n: int,
        max_gen: int,
        max_stops: int,
        max_len: int,
        k_max: int,
        device: torch.device | str,
    ) -> None:
        if max_gen > max_len or k_max >= max_len:  # the buffers would be sized by nothing real
            raise ValueError(
                f"slots of {max_len} cache positions cannot hold max_gen={max_gen} generated "
                f"tokens or k_max={k_max} draft tokens (at most {max_len} and {max_len - 1})"
            )
        self.k_max = k_max
        self.device = torch.device(device)
        long = dict(dtype=torch.long, device=device)
        flt = dict(dtype=torch.float32, device=device)
        self.pos = torch.zeros(n, **long)  # tokens already in the cache
        self.last = torch.zeros(n, **long)  # newest token, not yet in the cache
        self.n_gen = torch.zeros(n, **long)
        self.max_new = torch.zeros(n, **long)
        self.seed = torch.zeros(n, **long)
        self.temperature = torch.zeros(n, **flt)
        self.top_k = torch.zeros(n, **long)
        self.top_p = torch.ones(n, **flt)
        self.max_draft = torch.full((n,), -1, **long)
        self.stops = torch.full((n, max(max_stops, 1)), -1, **long)
        # k_max + 1 columns of slack: an iteration writes its K + 1 candidate tokens with
        # a mask (kept ones only) instead of gathering the kept indices on the host
        self.tokens = torch.zeros(n, max_gen + k_max + 1, **long)  # [S, max_gen + slack]
        self.logprobs = torch.zeros(n, max_gen + k_max + 1, **flt)
        self._history = torch.zeros(n, max_len + k_max + 2, **long)  # [S, L + slack]
        self.max_len = max_len
        self.finish = torch.zeros(n, **long)  # NONE / STOP / LENGTH / CONTEXT
        self.drafts = torch.zeros(n, **long)  # per-request speculation counters
        self.draft_tokens = torch.zeros(n, **long)
        self.accepted = torch.zeros(n, **long)
        self.accepted_pos = torch.zeros(n, max(k_max, 1), **long)  # [S, k_max]
        self.drafted_pos = torch.zeros(n, max(k_max, 1), **long)
        self.host = HostRows(n)
        """The same rows' host state: what the host sizes and steers iterations by."""

    @property
    def history(self) -> torch.Tensor:
        """[S, L] prompt + generated ids per slot (a view without the slack columns)."""
        return self._history[:, : self.max_len]

    def sampling(self, rows, span: range | None, hints: Hints | None = None) -> RowSampling:
        """The sampling settings of `rows` (index tensor or slice; `span`: the same slots
        as a host range), for draft and verifier, with their host-side `Hints` (those of
        `span`, or `hints` as given)."""
        if hints is None:
            hints = Hints.of([self.host.params[b] for b in span])
        return RowSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows], hints)

    def num_draft(self, n: int, k: int) -> torch.Tensor:
        """[n] tokens each of rows 0..n-1 may draft at depth k: its request's cap
        (`max_draft`, -1: none), and no more than its budget can keep (r tokens to go:
        r - 1 drafts and the bonus token). `HostRows.caps` is the same on the host."""
        cap = self.max_draft[:n].clamp(max=k)
        cap = torch.where(cap < 0, k, cap)
        return torch.minimum(cap, self.max_new[:n] - self.n_gen[:n] - 1)

    def tensors(self) -> list[torch.Tensor]:
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def move(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]
        self.host.move(src, dst)

    def admit(self, b: int, p: SamplingParams, j: int, seed: int, stops: tuple[int, ...]) -> None:
        """Slot b starts request j (parameters p, its seed and stop ids)."""
        cap = -1 if p.max_draft is None else p.max_draft
        params = (float(p.temperature), int(p.top_k), float(p.top_p))
        self.host.admit(b, j, params, p.max_new_tokens, cap)
        self.n_gen[b] = 0
        self.finish[b] = NONE
        self.drafts[b] = self.draft_tokens[b] = self.accepted[b] = 0
        self.accepted_pos[b] = self.drafted_pos[b] = 0
        self.max_new[b] = p.max_new_tokens
        self.seed[b] = seed
        self.temperature[b] = p.temperature
        self.top_k[b] = p.top_k
        self.top_p[b] = p.top_p
        self.max_draft[b] = cap
        self.stops[b] = -1
        if stops:
            self.stops[b, : len(stops)] = torch.tensor(stops, dtype=torch.long, device=self.device)

    def prompts(
        self,
        rows: torch.Tensor,
        span: range,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        host_lengths: list[int],
    ) -> None:
        """Prefilled rows: tokens [n, width] the padded prompts of `rows` (slots on the
        device; `span`: the same on the host), lengths [n] their lengths (`host_lengths`
        on the host). Each prompt's last token is the row's `last` (scored, entering the
        cache at its position)."""
        self.history[rows, : tokens.shape[1]] = tokens
        self.pos[rows] = lengths - 1
        for b, n in zip(span, host_lengths, strict=True):
            self.host.pos[b] = n - 1
        self.last[rows] = tokens[torch.arange(len(span), device=self.device), lengths - 1]

    def cut(
        self, rows: torch.Tensor, tokens: torch.Tensor, emitted: torch.Tensor, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """How many of an iteration's emitted tokens each of `rows` keeps, and its finish
        code: tokens [n, K+1] the verified candidates, emitted [n] how many were emitted,
        cut at the row's first stop token, its budget and the context window (ctx
        positions). Returns (count [n], finish [n])."""
        K1 = tokens.shape[1]
        col = torch.arange(K1, device=self.device)
        is_stop = (tokens.unsqueeze(-1) == self.stops[rows].unsqueeze(1)).any(-1) & (
            col < emitted.unsqueeze(1)
        )
        stop_at = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, K1 + 1)
        budget = self.max_new[rows] - self.n_gen[rows]
        room = ctx - 1 - self.pos[rows]  # tokens the context window still holds
        count = torch.minimum(torch.minimum(emitted, stop_at), torch.minimum(budget, room))
        finish = torch.where(
            stop_at <= count,
            STOP,
            torch.where(budget <= count, LENGTH, torch.where(room <= count, CONTEXT, NONE)),
        )
        return count, finish

    def record(
        self,
        rows: torch.Tensor,
        idx: torch.Tensor,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        emitted: torch.Tensor,
        count: torch.Tensor,
        finish: torch.Tensor,
        live: torch.Tensor | None = None,
    ) -> None:
        """An iteration's verified tokens for `rows` ([n] slots): the first count[b] of
        row b's K + 1 candidates (tokens, logprobs: [n, K+1], at output indices idx
        [n, K+1]) are kept, written with a mask into the slack columns; its cache position
        advances by emitted[b] (the tokens that entered the cache), its finish code
        becomes finish[b]. `live` [n]: the rows that are not a captured step's padding
        (None: all); a padding row emits nothing and keeps its `last`."""
        col = torch.arange(tokens.shape[1], device=self.device)
        keep = col < count.unsqueeze(1)  # [n, K+1]
        r2 = rows.unsqueeze(1)  # [n, 1]
        hpos = self.pos[rows].unsqueeze(1) + 1 + col  # [n, K+1] history position of each
        self.tokens[r2, idx] = torch.where(keep, tokens, self.tokens[r2, idx])
        self.logprobs[r2, idx] = torch.where(keep, logprobs, self.logprobs[r2, idx])
        self._history[r2, hpos] = torch.where(keep, tokens, self._history[r2, hpos])
        at = emitted - 1 if live is None else (emitted - 1).clamp(min=0)  # [n]
        last = tokens.gather(1, at.unsqueeze(1)).squeeze(1)  # [n]
        if live is not None:
            last = torch.where(live, last, self.last[rows])
        self.last[rows] = last
        self.pos[rows] += emitted
        self.n_gen[rows] += count
        self.finish[rows] = finish

    def outputs(
        self,
        rows: torch.Tensor,
        ver: VerifyOutput | TreeVerifyOutput,
        num_draft: torch.Tensor,
        ctx: int,
        nodes: torch.Tensor | None = None,
        hits: torch.Tensor | None = None,
        live: torch.Tensor | None = None,
    ) -> StepOutputs:
        """Record each row's verified tokens up to its first stop condition, on the device.

        rows: [n] the slots; ver: the verification of K drafted positions per row (chain
        or tree), num_draft [n] the positions each row drafted, nodes [n] the candidates
        it verified (a tree's may exceed num_draft; None: none), hits [k] per tree node
        the rows whose accepted path went through it (what the depth policy learns from a
        tree), live [n] the rows that are not padding (None: all). Every row advances its
        cache position by the tokens that entered the cache (`last` + accepted drafts).

        Returns what the host needs to learn of the iteration, which it reads back once
        (`StepOutputs.pack`): on a GPU, the one stall of an iteration (`engine.syncs`),
        and all that drafters working on the host (history) learn of it.
        """
        n, K1 = ver.tokens.shape
        long = dict(dtype=torch.long, device=self.device)
        idx = self.n_gen[rows].unsqueeze(1) + torch.arange(K1, **long)  # [n, K+1] output index
        emitted = ver.num_emitted  # [n]
        out = ver.tokens.clamp(min=0)  # [n, K+1]
        if live is not None:  # padding rows emit nothing and keep nothing
            emitted = torch.where(live, emitted, 0)
        count, finish = self.cut(rows, out, emitted, ctx)
        if live is not None:
            count = torch.where(live, count, 0)
            finish = torch.where(live, finish, self.finish[rows])
        self.record(rows, idx, out, ver.logprobs, emitted, count, finish, live)
        drafted = self.count_drafts(rows, num_draft, ver.num_accepted, ver.accepted)
        nodes = torch.zeros_like(num_draft) if nodes is None else nodes
        outs = StepOutputs(emitted, count, finish, num_draft, ver.num_accepted, nodes, out)
        if drafted is not None:  # per-position totals: statistics, depth policy
            outs.accepted_at, outs.drafted_at = ver.accepted.sum(0), drafted.sum(0)
            outs.learned = hits if hits is not None else (ver.accepted & drafted).sum(0)
        return outs

    def count_drafts(
        self,
        rows: torch.Tensor,
        num_draft: torch.Tensor,
        num_accepted: torch.Tensor,
        accepted: torch.Tensor,
    ) -> torch.Tensor | None:
        """Add an iteration's speculation to the counters of `rows`: num_draft [n] tokens
        drafted, num_accepted [n] of them kept, accepted [n, K] which. Returns drafted
        [n, K], the positions each row drafted (None when K = 0)."""
        K = accepted.shape[1]
        self.drafts[rows] += (num_draft > 0).long()
        self.draft_tokens[rows] += num_draft
        self.accepted[rows] += num_accepted
        if K == 0:
            return None
        drafted = torch.arange(K, device=self.device) < num_draft.unsqueeze(1)  # [n, K]
        self.accepted_pos[rows, :K] += accepted.long()
        self.drafted_pos[rows, :K] += drafted.long()
        return drafted

    def result(
        self, b: int, req: Request, seed: int, reason: str, versions: tuple[int, int | None]
    ) -> Result:
        """The finished request in slot b; versions: (policy, draft) it generated with."""
        n, j, k = int(self.n_gen[b]), self.host.request[b], self.k_max
        return Result(
            request_id=j if req.request_id is None else req.request_id,
            prompt_ids=list(req.prompt_ids),
            token_ids=self.tokens[b, :n].tolist(),
            logprobs=self.logprobs[b, :n].tolist(),
            finish_reason=reason,
            seed=seed,
            policy_version=versions[0],
            draft_version=versions[1],
            spec=SpecStats(
                drafts=int(self.drafts[b]),
                draft_tokens=int(self.draft_tokens[b]),
                accepted_tokens=int(self.accepted[b]),
                accepted_per_pos=self.accepted_pos[b, :k].tolist(),
                drafted_per_pos=self.drafted_pos[b, :k].tolist(),
            ),
            first_token_s=0.0,
            latency_s=0.0,
        )
