"""The engine's rows on the device, slot-indexed tensors (row b = cache slot b), so that
a decoding step is a handful of tensor ops whatever the batch size.

Two kinds of tensor: each row's state (position, newest token, counts, seed, sampling
settings, draft cap), derived from the host's truth (`host`: `engine.rows.HostRows`)
and copied in once per step (`load`), which the step reads and never writes; and the
data steps write (`DATA`: tokens, logprobs, history, counters) or that admission
writes once (stop ids)."""

from __future__ import annotations

import torch

from specroll.device import copy_in
from specroll.engine.request import Request, Result, SamplingParams
from specroll.engine.rows import CONTEXT, LENGTH, NONE, STATE, STATE_F, STOP, HostRows
from specroll.engine.step import StepOutputs
from specroll.spec.metrics import SpecStats
from specroll.spec.sampling import Hints, RowSampling
from specroll.spec.tree import TreeVerifyOutput
from specroll.spec.verify import VerifyOutput

DATA = ("stops", "tokens", "logprobs", "_history", "drafts", "draft_tokens", "accepted")
DATA += ("accepted_pos", "drafted_pos")
"""The slots' tensors that are data, not row state: written by steps, moved with a row."""


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
        # each row's state, derived from the host's (`host`) and copied in once per
        # step (`load`): the step reads it and never writes it (`STATE`'s order)
        self._state = torch.zeros(len(STATE), n, **long)  # [7, S]
        self._state_f = torch.zeros(len(STATE_F), n, **flt)  # [2, S]
        self.pos, self.last, self.n_gen, self.left, self.seed, self.top_k, self.max_draft = (
            self._state.unbind(0)
        )
        """Tokens already in the cache; the newest token (not yet in it); tokens
        generated; tokens it may still generate; its seed; its top-k; its draft cap."""
        self.temperature, self.top_p = self._state_f.unbind(0)
        self.stops = torch.full((n, max(max_stops, 1)), -1, **long)
        # k_max + 1 columns of slack: an iteration writes its K + 1 candidate tokens with
        # a mask (kept ones only) instead of gathering the kept indices on the host
        self.tokens = torch.zeros(n, max_gen + k_max + 1, **long)  # [S, max_gen + slack]
        self.logprobs = torch.zeros(n, max_gen + k_max + 1, **flt)
        self._history = torch.zeros(n, max_len + k_max + 2, **long)  # [S, L + slack]
        self.max_len = max_len
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
        return torch.minimum(cap, self.left[:n] - 1)

    def load(self) -> None:
        """Copy the host's row state in (`HostRows.state`): a step's one host-to-device
        copy, queued without a sync, before the step (or a prefill) reads it."""
        ints, floats = self.host.state()
        copy_in(self._state, torch.tensor(ints, dtype=torch.long, device="cpu"))
        copy_in(self._state_f, torch.tensor(floats, dtype=torch.float32, device="cpu"))

    def data(self) -> list[torch.Tensor]:
        """What the device keeps of each row beside its state: its stop ids, tokens,
        logprobs, history and speculation counters."""
        return [v for k, v in vars(self).items() if isinstance(v, torch.Tensor) and k in DATA]

    def move(self, src: int, dst: int) -> None:
        for t in self.data():
            t[dst] = t[src]
        self.host.move(src, dst)

    def admit(self, b: int, p: SamplingParams, j: int, seed: int, stops: tuple[int, ...]) -> None:
        """Slot b starts request j (parameters p, its seed and stop ids)."""
        cap = -1 if p.max_draft is None else p.max_draft
        params = (float(p.temperature), int(p.top_k), float(p.top_p))
        self.host.admit(b, j, params, p.max_new_tokens, cap, seed)
        self.drafts[b] = self.draft_tokens[b] = self.accepted[b] = 0
        self.accepted_pos[b] = self.drafted_pos[b] = 0
        self.stops[b] = -1
        if stops:
            self.stops[b, : len(stops)] = torch.tensor(stops, dtype=torch.long, device=self.device)

    def prompts(
        self,
        rows: torch.Tensor,
        span: range,
        tokens: torch.Tensor,
        prompts: list[list[int]],
    ) -> None:
        """Prefilled rows: tokens [n, width] the padded `prompts` of `rows` (slots on the
        device; `span`: the same on the host). Each prompt's last token is the row's
        `last` (scored, entering the cache at its position)."""
        self.history[rows, : tokens.shape[1]] = tokens
        for b, ids in zip(span, prompts, strict=True):
            self.host.prompt(b, ids)

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
        budget = self.left[rows]
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
        count: torch.Tensor,
    ) -> None:
        """An iteration's verified tokens for `rows` ([n] slots): the first count[b] of
        row b's K + 1 candidates (tokens, logprobs: [n, K+1], at output indices idx
        [n, K+1]) are kept, written with a mask into the slack columns, and into the
        history after the row's position. (Its position, `last` and counts move on in
        the host's state, from the step's read: `HostRows.advance`.)"""
        col = torch.arange(tokens.shape[1], device=self.device)
        keep = col < count.unsqueeze(1)  # [n, K+1]
        r2 = rows.unsqueeze(1)  # [n, 1]
        hpos = self.pos[rows].unsqueeze(1) + 1 + col  # [n, K+1] history position of each
        self.tokens[r2, idx] = torch.where(keep, tokens, self.tokens[r2, idx])
        self.logprobs[r2, idx] = torch.where(keep, logprobs, self.logprobs[r2, idx])
        self._history[r2, hpos] = torch.where(keep, tokens, self._history[r2, hpos])

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
        tree), live [n] the rows that are not padding (None: all).

        Returns what the host needs to learn of the iteration, which it reads back once
        (`StepOutputs.pack`): on a GPU, the one stall of an iteration (`engine.syncs`),
        and all that the host's rows (`HostRows.advance`: each advances its cache
        position by the tokens that entered the cache) and drafters working on the host
        (history) learn of it.
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
            finish = torch.where(live, finish, NONE)
        self.record(rows, idx, out, ver.logprobs, count)
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
        n, j, k = self.host.n_gen[b], self.host.request[b], self.k_max
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
