"""The learner: log-prob recomputation (stage `logprob`) and the update (stage `train`).

One policy forward per micro-batch serves both objectives (paper §2.4, NeMo-RL #2078):
the GRPO/DAPO loss on the policy's log-probs, and the online draft loss (any
`TrainableDraft`: EAGLE-3 reads three aux layers, MTP the final state) on the states of
that *same* forward, read through `detach()` together with the detached policy
distribution as the target. The total is L = L_policy(theta) + lambda * L_draft(phi) with
no path between them: the draft loss cannot move a policy weight and the policy loss
cannot move a draft weight (tested to be exactly zero). Each has its own AdamW and its
own gradient clipping.

Token convention: tokens [N, T] are prompt + response padded; logp[:, i] is the policy's
tempered log-prob of tokens[:, i] given tokens[:, :i] (from the logits at i - 1); the
response mask marks i in [prompt_len, length).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specroll.drafters.trainable import TrainableDraft
from specroll.drafting.train import draft_loss
from specroll.model.transformer import Transformer
from specroll.rl import loss as L
from specroll.rl.config import DraftConfig, LossConfig, PolicyConfig, RolloutConfig


@dataclass
class Batch:
    """Rollouts of one step, padded."""

    tokens: torch.Tensor
    """[N, T] prompt + response ids."""
    prompt_lens: torch.Tensor
    """[N]."""
    lengths: torch.Tensor
    """[N] prompt + response lengths."""
    advantages: torch.Tensor
    """[N] one advantage per sequence."""
    behaviour_logp: torch.Tensor
    """[N, T] the engine's log-probs of the response tokens (0 elsewhere)."""

    @property
    def response_mask(self) -> torch.Tensor:
        i = torch.arange(self.tokens.shape[1]).view(1, -1)
        return (i >= self.prompt_lens.view(-1, 1)) & (i < self.lengths.view(-1, 1))

    @classmethod
    def from_results(cls, results: list, advantages: torch.Tensor) -> Batch:
        """Rollout results (prompt, tokens, engine log-probs) padded into one batch."""
        n = len(results)
        lens = [len(r.prompt_ids) + len(r.token_ids) for r in results]
        W = max(lens)
        tokens = torch.zeros(n, W, dtype=torch.long)
        beh = torch.zeros(n, W)
        for i, r in enumerate(results):
            P = len(r.prompt_ids)
            tokens[i, : lens[i]] = torch.tensor(r.prompt_ids + r.token_ids)
            beh[i, P : lens[i]] = torch.tensor(r.logprobs)
        return cls(
            tokens,
            torch.tensor([len(r.prompt_ids) for r in results]),
            torch.tensor(lens),
            advantages.float(),
            beh,
        )

    def rows(self, idx: list[int]) -> Batch:
        width = int(self.lengths[idx].max())
        return Batch(
            self.tokens[idx, :width],
            self.prompt_lens[idx],
            self.lengths[idx],
            self.advantages[idx],
            self.behaviour_logp[idx, :width],
        )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N, T, V] logits, [N, T] tokens → [N, T] log p(tokens[i] | < i) (0 at i = 0)."""
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)  # [N, T-1]
    return F.pad(picked, (1, 0))


class Learner:
    """Policy (+ optional online draft) optimisation."""

    def __init__(
        self,
        policy: Transformer,
        *,
        policy_cfg: PolicyConfig,
        loss_cfg: LossConfig,
        rollout_cfg: RolloutConfig,
        draft: TrainableDraft | None = None,
        draft_cfg: DraftConfig | None = None,
        reference: Transformer | None = None,
        decoupled: bool = False,
    ) -> None:
        self.decoupled = decoupled
        """Reweight by pi_prox / pi_behaviour (async: samples from older policies)."""
        self.policy, self.pcfg, self.lcfg = policy, policy_cfg, loss_cfg
        self.temperature = rollout_cfg.temperature
        """The sampling temperature, read from the config the engine's requests come from:
        the log-probs of the update are those of the distribution that was sampled."""
        self.draft = draft if (draft is not None and draft_cfg and draft_cfg.online) else None
        self.dcfg = draft_cfg
        self.reference = reference
        self._share = functools.partial(L.micro_share, token_level=loss_cfg.token_level)
        """The loss variant, chosen once: this micro-batch's share of the aggregate."""
        policy.for_training()
        self.opt = torch.optim.AdamW(
            policy.parameters(),
            lr=policy_cfg.lr,
            betas=(0.9, 0.99),
            weight_decay=policy_cfg.weight_decay,
        )
        self.hidden_layers: tuple[int, ...] = ()
        """Policy states the train forward returns: what the online draft reads."""
        self.draft_opt = None
        if self.draft is not None:
            last = (policy.cfg.num_layers,) if self.draft.reads_final else ()
            self.hidden_layers = (*self.draft.aux_layers, *last)
            self.draft.for_training()
            self.draft_opt = torch.optim.AdamW(
                self.draft.parameters(), lr=draft_cfg.lr, betas=(0.9, 0.95)
            )

    # ------------------------------------------------------------------ stage: logprob

    @torch.no_grad()
    def logprobs(self, batch: Batch, model: Transformer | None = None) -> torch.Tensor:
        """[N, T] tempered log-probs of `batch.tokens` under `model` (default: the policy)."""
        model = model or self.policy
        out = torch.zeros(batch.tokens.shape)
        for idx in self._micro(batch):
            b = batch.rows(idx)
            logits = model(b.tokens).logits
            out[idx, : b.tokens.shape[1]] = token_logprobs(logits, b.tokens, self.temperature)
        return out * batch.response_mask

    def _micro(self, batch: Batch) -> list[list[int]]:
        order = sorted(range(batch.tokens.shape[0]), key=lambda i: int(batch.lengths[i]))
        m = self.pcfg.micro_batch
        return [order[i : i + m] for i in range(0, len(order), m)]

    # ------------------------------------------------------------------ stage: train

    def train(
        self, batch: Batch, old_logp: torch.Tensor, ref_logp: torch.Tensor | None = None
    ) -> dict:
        """`updates_per_step` optimizer steps over disjoint parts of the batch."""
        N = batch.tokens.shape[0]
        perm = list(range(N))
        parts = [perm[u :: self.lcfg.updates_per_step] for u in range(self.lcfg.updates_per_step)]
        stats: dict[str, list[float]] = {}
        for part in parts:
            if part:
                for k, v in self._update(batch, part, old_logp, ref_logp).items():
                    stats.setdefault(k, []).append(v)
        out: dict = {}
        for k, v in stats.items():  # mean over updates (per position for lists)
            out[k] = (
                [sum(x) / len(v) for x in zip(*v, strict=True)]
                if isinstance(v[0], list)
                else sum(v) / len(v)
            )
        return out

    def _update(self, batch: Batch, part: list[int], old_logp, ref_logp) -> dict:
        sub = Batch(
            *(
                getattr(batch, f)[part]
                for f in ("tokens", "prompt_lens", "lengths", "advantages", "behaviour_logp")
            )
        )
        mask_all = sub.response_mask
        n_tokens = float(mask_all.sum().clamp(min=1))
        n_seqs = float(len(part))
        self.opt.zero_grad(set_to_none=True)
        if self.draft_opt is not None:
            self.draft_opt.zero_grad(set_to_none=True)
        acc = {"policy_loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "draft_loss": 0.0}
        draft_acc: list[list[float]] = []
        for idx in self._micro(sub):
            b = sub.rows(idx)
            rows = torch.tensor([part[i] for i in idx])
            W = b.tokens.shape[1]
            mask = b.response_mask
            out = self.policy(b.tokens, hidden_layers=self.hidden_layers)
            logp = token_logprobs(out.logits, b.tokens, self.temperature)
            per_tok, clipped = L.clipped_objective(
                logp, old_logp[rows, :W], b.advantages, self.lcfg.clip_low, self.lcfg.clip_high
            )
            if self.decoupled:
                per_tok = per_tok * L.behaviour_weight(
                    old_logp[rows, :W], b.behaviour_logp, self.lcfg.behaviour_weight_cap
                )
            if self.lcfg.kl_coef > 0 and ref_logp is not None:
                kl = L.kl_k3(logp, ref_logp[rows, :W])
                per_tok = per_tok + self.lcfg.kl_coef * kl
                acc["kl"] += float((kl.detach() * mask).sum()) / n_tokens  # a statistic only
            m = mask.float()
            loss = self._share(per_tok, mask, n_tokens, n_seqs)
            acc["policy_loss"] += loss.detach().item()
            acc["clip_frac"] += float((clipped.detach() * m).sum()) / n_tokens
            total = loss
            if self.draft is not None:
                dl, dm = self._draft_loss(b, out)
                total = total + self.dcfg.weight * dl * (len(idx) / n_seqs)
                acc["draft_loss"] += dl.detach().item() * len(idx) / n_seqs
                draft_acc.append(dm["accept"])
            total.backward()
        acc["grad_norm"] = float(
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.pcfg.grad_clip)
        )
        self.opt.step()
        if self.draft_opt is not None:
            params = list(self.draft.parameters())
            acc["draft_grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(params, self.dcfg.grad_clip)
            )
            self.draft_opt.step()
            acc["draft_accept"] = [  # mean over the micro-batches that reached step j
                sum(a[j] for a in draft_acc if not math.isnan(a[j]))
                / max(1, sum(not math.isnan(a[j]) for a in draft_acc))
                for j in range(len(draft_acc[0]))
            ]
        return acc

    def _draft_loss(self, b: Batch, out) -> tuple[torch.Tensor, dict]:
        """Online draft loss on this forward's detached features and distribution."""
        d = self.draft
        states = [out.hidden[i].detach() for i in d.aux_layers]
        aux = torch.cat(states, dim=-1) if states else out.logits.new_zeros((*b.tokens.shape, 0))
        final = None
        if d.reads_final:
            with torch.no_grad():
                final = self.policy.final_state(out.hidden[self.policy.cfg.num_layers])
        logits = out.logits.detach()
        vocab = d.vocab

        def target(mask: torch.Tensor) -> torch.Tensor:
            logp = F.log_softmax(logits[mask].float() / self.temperature, dim=-1)
            return logp if vocab is None else logp[:, vocab]

        return draft_loss(
            d,
            b.tokens,
            aux=aux,
            final=final,
            lengths=b.lengths,
            prompt_lens=b.prompt_lens,
            target_logp=target,
            steps=self.dcfg.ttt_steps,
            decay=self.dcfg.step_decay,
        )
