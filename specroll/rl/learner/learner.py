"""The learner: log-prob recomputation (stage `logprob`) and the update (stage `train`).

One policy forward per micro-batch serves both objectives (paper §2.4, NeMo-RL #2078):
the GRPO/DAPO loss on the policy's log-probs, and the online draft loss (any
`TrainableDraft`: EAGLE-3 reads three aux layers, MTP the final state) on the states of
that *same* forward, read through `detach()` together with the detached policy
distribution as the target. The total is L = L_policy(theta) + lambda * L_draft(phi) with
no path between them: the draft loss cannot move a policy weight and the policy loss
cannot move a draft weight (tested to be exactly zero). Each has its own AdamW and its
own gradient clipping.

Token convention: see `rl.algo.batch`; the head and its log-softmax: `rl.algo.logprobs`.
The forward both stages share, and stage `logprob`: `rl.learner.scoring` (`Scorer`, this
class's base); the figures an update reports, and which must be finite:
`rl.learner.update_stats`.

Placement: `learner.device` / `learner.dtype`. Batches arrive on the CPU and move to the
learner's device here; `logprobs` returns CPU fp32; `train` returns floats, read once
per update (statistics accumulate on the device). bf16 is autocast over fp32 master
weights and fp32 AdamW state; log-softmax, the loss and the draft loss stay fp32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import fields

import torch

from specroll.drafting.trainable import TrainableDraft
from specroll.drafting.ttt import draft_loss as ttt_loss
from specroll.model import lora
from specroll.model.transformer import Transformer
from specroll.rl.algo import loss
from specroll.rl.algo.batch import Batch, MicroBatch
from specroll.rl.config import DraftConfig, LossConfig, PolicyConfig
from specroll.rl.config.rollout import RolloutConfig
from specroll.rl.errors import NonFiniteError
from specroll.rl.learner.memory import keep_freed_memory
from specroll.rl.learner.scoring import Scorer
from specroll.rl.learner.update_stats import (
    STAT_TERMS,
    full,
    mean_over_updates,
    micro_stats,
    nonfinite,
    settle_extremes,
)


class Learner(Scorer):
    """Policy (+ optional online draft) optimisation on `device` in `dtype`.

    On the CPU, constructing one also makes glibc keep freed memory for reuse in this
    process (`keep_freed_memory`)."""

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
        base_reference: bool = False,
        decoupled: bool = False,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.decoupled = decoupled
        """Reweight by pi_prox / pi_behaviour (async: samples from older policies)."""
        self.device, self.dtype = torch.device(device), dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"learner dtype must be float32 or bfloat16, got {dtype}")
        self.policy, self.pcfg, self.lcfg = policy, policy_cfg, loss_cfg
        self.temperature = rollout_cfg.temperature
        """The sampling temperature, read from the config the engine's requests come from:
        the log-probs of the update are those of the distribution that was sampled."""
        self.top_k, self.top_p = rollout_cfg.top_k, rollout_cfg.top_p
        """The rollouts' top-k / top-p: the log-probs are the truncated distribution's."""
        self.draft = draft if (draft is not None and draft_cfg and draft_cfg.online) else None
        self.dcfg = draft_cfg
        self.reference = reference
        self.base_reference = base_reference
        """The KL reference is the policy with its adapters off (a LoRA policy whose
        adapters started at zero), not the `reference` copy."""
        self.dp = None
        """Data parallelism over ranks (`fsdp.shard.DataParallel`), or None in one process:
        which micro-batches this rank runs, and the sums over ranks."""
        self._loss_share = functools.partial(
            loss.micro_share,
            aggregation=loss_cfg.aggregation,
            max_len=rollout_cfg.max_new_tokens,
        )
        """The loss aggregation, chosen once: a micro-batch's share of the update's loss."""
        if self.device.type == "cpu":
            keep_freed_memory()
        # master weights stay fp32 wherever the learner computes (`.to` moves parameters in
        # place, so a draft that references the policy's embedding keeps referencing it)
        policy.to(self.device).for_training()
        if reference is not None:
            # scored exactly like the policy (no prepacked copies): KL = 0 at step 0
            reference.to(self.device).for_training()
        if draft is not None:
            draft.to(self.device)
        self.trained = [p for p in policy.parameters() if p.requires_grad]
        """What the policy's optimizer steps: every weight, or only the adapters of a
        LoRA policy (`model.lora.attach` freezes its base: no optimizer state for it)."""
        self.opt = torch.optim.AdamW(
            self.trained,
            lr=policy_cfg.lr,
            betas=(0.9, 0.99),
            weight_decay=policy_cfg.weight_decay,
            **_fused(self.device),
        )
        self.hidden_layers: tuple[int, ...] = (policy.cfg.num_layers,)
        """Policy states the train forward returns: the last (the LM head's input) and
        what the online draft reads."""
        self.draft_opt = None
        if self.draft is not None:
            self.hidden_layers = tuple(sorted({*self.draft.aux_layers, policy.cfg.num_layers}))
            self.draft.for_training()
            self.draft_opt = torch.optim.AdamW(
                self.draft.parameters(), lr=draft_cfg.lr, betas=(0.9, 0.95), **_fused(self.device)
            )

    def reference_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """[N, T] the KL reference's log-probs of `batch` (`logprobs`), or None without KL."""
        if self.reference is not None:
            return self.logprobs(batch, self.reference)
        if self.base_reference:
            with lora.disabled(self.policy):
                return self.logprobs(batch)
        return None

    # ------------------------------------------------------------------ stage: train

    def train(
        self,
        batch: Batch,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None = None,
        lr: float | None = None,
    ) -> dict:
        """`updates_per_step` optimizer steps over disjoint parts of the batch at learning
        rate `lr` (the step's, `learner.schedule`; None keeps the optimizer's); the mean
        statistics of the updates, as floats.

        old_logp: [N, T] the old policy's log-probs (stage `logprob`, or the engine's), or
        None for an on-policy step with one update: the old log-probs are then the train
        forward's own, detached, which is what recomputing them would give (same weights,
        same operations) without the extra forward."""
        if old_logp is None and self.lcfg.updates_per_step != 1:
            raise ValueError(
                "old_logp=None (the train forward's own log-probs) needs loss.updates_per_step"
                f" = 1 (the weights change between updates); got {self.lcfg.updates_per_step}"
            )
        if lr is not None:  # set, not stepped: the rate is a function of the RL step
            for group in self.opt.param_groups:
                group["lr"] = lr
        batch = batch.to(self.device)
        old_logp = old_logp.to(self.device) if old_logp is not None else None
        ref_logp = ref_logp.to(self.device) if ref_logp is not None else None
        N = batch.tokens.shape[0]
        perm = list(range(N))
        parts = [perm[u :: self.lcfg.updates_per_step] for u in range(self.lcfg.updates_per_step)]
        stats: dict[str, list] = {}
        for part in parts:
            if part:
                for k, v in self._update(batch, part, old_logp, ref_logp).items():
                    stats.setdefault(k, []).append(v)
        out = mean_over_updates(stats)
        out["lr"] = self.opt.param_groups[0]["lr"]
        return out

    def _update(self, batch: Batch, part: list[int], old_logp, ref_logp) -> dict:
        sel = torch.tensor(part, device=self.device)
        sub = Batch(*(getattr(batch, f.name)[sel] for f in fields(Batch)))
        old_logp = old_logp[sel] if old_logp is not None else None
        ref_logp = ref_logp[sel] if ref_logp is not None else None
        micros = self._mine(self._micro(sub))
        if self.dp is None:
            n_tokens = float(sub.response_mask.sum().clamp(min=1))
        else:  # the global count (all ranks' shares), not this rank's: a global mean
            n_tokens = self.dp.token_count(sub.response_mask, [m.idx for m, r in micros if r])
        self.opt.zero_grad(set_to_none=True)
        if self.draft_opt is not None:
            self.draft_opt.zero_grad(set_to_none=True)
        acc, draft_acc = self._backward(sub, micros, old_logp, ref_logp, n_tokens, len(part))
        return self._step(acc, draft_acc)

    def _backward(
        self,
        sub: Batch,
        micros: list[tuple[MicroBatch, bool]],
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        n_tokens: float,
        n_seqs: int,
    ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of every micro-batch of one update (gradients accumulate);
        returns the update's statistics and the online draft's per-micro-batch acceptance
        ([steps] each), all as device tensors."""
        n_seqs = float(n_seqs)
        cap = loss.weight_cap(self.lcfg, self.decoupled)
        use_ref = self.lcfg.kl_coef > 0 and ref_logp is not None
        # statistics as device tensors: one host read per update, not per micro-batch
        # (float64: the sums of per-micro-batch fp32 figures are the host's double sums)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        acc = {"policy_loss": zero, "clip_frac": zero, "kl": zero, "draft_loss": zero}
        acc.update(clip_frac_low=zero, clip_frac_high=zero, entropy=zero, ratio_mean=zero)
        if self.top_k > 0 or self.top_p < 1:
            acc["outside_support"] = zero
        if cap is not None and self.lcfg.tis_cap > 0:
            acc["tis_clip_frac"] = zero
        # the extremes of the ratio pi / pi_old over the update's tokens (max-reduced:
        # the minimum as the maximum of its negation)
        ext = torch.full((2,), -math.inf, dtype=torch.float64, device=self.device)
        draft_acc: list[torch.Tensor] = []
        vocab = self.draft_vocab()
        shared = self._prompt_pass(self.policy, sub, micros)
        for m, real in micros:
            b = sub.rows(m.idx, m.width)
            rows = torch.tensor(m.idx, device=self.device)
            W = m.width
            mask = b.response_mask
            logp, target, hidden, ent = self.forward(
                self.policy,
                b,
                vocab,
                m.where(b, self.device),
                entropy=True,
                shared=None if shared is None else (shared, m),
            )
            per_tok, terms = loss.token_objective(
                logp,
                old_logp[rows, :W] if old_logp is not None else logp.detach(),
                b.advantages,
                self.lcfg,
                behaviour_logp=b.behaviour_logp,
                cap=cap,
                ref_logp=ref_logp[rows, :W] if use_ref else None,
            )
            policy_loss = self._loss_share(per_tok, mask, n_tokens, n_seqs)
            if not real:  # a dummy: its forward and backward only keep the ranks in step
                policy_loss = policy_loss * 0.0
                terms = {k: v * 0 if k not in STAT_TERMS else v for k, v in terms.items()}
            acc["policy_loss"] = acc["policy_loss"] + policy_loss.detach()
            ext = micro_stats(acc, ext, terms, ent, mask, real, n_tokens)
            total = policy_loss
            if self.draft is not None:
                dl, dm = self.draft_loss(b, hidden, target)
                dl = dl if real else dl * 0.0
                total = total + self.dcfg.weight * dl * (len(m.idx) / n_seqs)
                acc["draft_loss"] = acc["draft_loss"] + dl.detach().double() * len(m.idx) / n_seqs
                draft_acc.append(dm["accept"] if real else torch.full_like(dm["accept"], math.nan))
            total.backward()
        if shared is not None:  # the prompts' share of the gradient, once
            shared.backward()
        acc["ratio_max"], acc["ratio_min"] = ext[0], ext[1]  # (max-reduced; see `_step`)
        return acc, draft_acc

    def _step(self, acc: dict[str, torch.Tensor], draft_acc: list[torch.Tensor]) -> dict:
        """Clip and step both optimizers; the update's statistics, read in one go."""
        if self.dp is not None and self.draft is not None:
            self.dp.sum_grads(self.draft.parameters())  # the replicated draft: summed grads
        top = torch.stack([acc.pop("ratio_max"), acc.pop("ratio_min")])  # [max, -min]
        keys = list(acc)
        sums = torch.stack([acc[k].double() for k in keys])
        if self.dp is not None:
            self.dp.sum_(sums)
            self.dp.max_(top)
        sums = torch.cat([sums, top])
        keys += ["ratio_max", "ratio_min"]
        # under FSDP the policy's clipping norm is a DTensor: its global value
        acc = {"grad_norm": full(_clip_grad(self.trained, self.pcfg.grad_clip))}
        if self.draft_opt is not None:
            params = list(self.draft.parameters())
            acc["draft_grad_norm"] = full(_clip_grad(params, self.dcfg.grad_clip))
        keys += list(acc)
        values = torch.cat([sums, torch.stack([v.double() for v in acc.values()])])
        if self.draft_opt is not None:
            # the draft's acceptance per step j, summed over the micro-batches (of all
            # ranks) that reached it, with their count: [2, steps]
            a = torch.stack(draft_acc).double()  # [micro-batches, steps]
            tot = torch.stack([a.nan_to_num().sum(0), (~a.isnan()).sum(0).double()])
            if self.dp is not None:
                self.dp.sum_(tot)
            values = torch.cat([values, tot.flatten()])
        read = values.tolist()  # the one host read
        out: dict = dict(zip(keys, read[: len(keys)], strict=True))
        settle_extremes(out)
        bad = nonfinite(out)
        if bad:  # every rank read the same global figures: all skip the step together
            self.opt.zero_grad(set_to_none=True)
            if self.draft_opt is not None:
                self.draft_opt.zero_grad(set_to_none=True)
            figures = ", ".join(f"{k} {out[k]}" for k in bad)
            raise NonFiniteError(f"{figures}: the update was not applied")
        self.opt.step()
        if self.draft_opt is not None:
            self.draft_opt.step()
        if self.draft_opt is not None:
            # mean over the micro-batches (of all ranks) that reached step j
            tot = read[len(keys) :]
            steps = len(tot) // 2
            pairs = zip(tot[:steps], tot[steps:], strict=True)
            out["draft_accept"] = [s / max(c, 1.0) for s, c in pairs]
        return out

    def draft_vocab(self) -> torch.Tensor | None:
        """Target ids of the online draft's vocabulary on the learner's device (all ids:
        an arange, when the draft predicts the whole vocabulary); None without a draft."""
        if self.draft is None:
            return None
        v = self.draft.vocab
        if v is None:
            return torch.arange(self.policy.cfg.vocab_size, device=self.device)
        return v.to(self.device)

    def draft_loss(
        self, b: Batch, hidden: dict[int, torch.Tensor], target: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """Online draft loss on this forward's detached features and distribution.

        target: [n, V'] the policy's tempered log-probs over the draft vocabulary at the
        positions `loss_mask` selects (computed by `_forward` with the policy's head)."""
        d = self.draft
        states = [hidden[i].detach() for i in d.aux_layers]
        aux = (
            torch.cat(states, dim=-1)
            if states
            else hidden[self.policy.cfg.num_layers].new_zeros((*b.tokens.shape, 0))
        )
        final = None
        if d.reads_final:
            with torch.no_grad():
                final = self.policy.final_state(hidden[self.policy.cfg.num_layers])

        def target_logp(mask: torch.Tensor) -> torch.Tensor:
            return target  # the rows of `mask` (the same positions, the same order)

        with self._autocast():
            return ttt_loss(
                d,
                b.tokens,
                aux=aux,
                final=final,
                lengths=b.lengths,
                prompt_lens=b.prompt_lens,
                target_logp=target_logp,
                steps=self.dcfg.ttt_steps,
                decay=self.dcfg.step_decay,
                on_device=True,  # read once per update, in `_step`
            )


_clip_grad = torch.nn.utils.clip_grad_norm_


def _fused(device: torch.device) -> dict:
    """AdamW's fused kernel where this torch has one for the device: one pass over each
    parameter instead of ~10 element-wise kernels (numerics equal to float rounding;
    timings in docs/performance_notes.md)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        supported = device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # a torch without the helper: the default implementation
        supported = False
    return {"fused": True} if supported else {}
