"""Training-time test (TTT): unroll a feature drafter the way the engine will run it.

At inference the drafter's first step reads the *target's* feature f_t with token
x_{t+1} (position t); step j >= 1 reads the drafter's *own* state from step j-1 with the
token drafted before it, at position t + j, and attends to the target-fed pairs 0..t plus
the earlier steps of its own chain. Training only on step 0 (teacher forcing) leaves the
drafter blind to its own errors, which is why acceptance decays with depth. TTT trains
every step on exactly the inference inputs: for each anchor t, step j feeds the state of
step j-1 at anchor t and the real token x_{t+1+j}, and attends with the
causal-plus-diagonal pattern: step-0 keys at anchors <= t, and the step-i keys (1 <= i <=
j) of anchor t only (EAGLE-3, arXiv 2503.01840 §3; SpecForge's `eagle3` trainer). The
data are the policy's own samples at the RL temperature, so x_{t+1+j} is distributed like
a draft that the target accepted. A test checks the unroll against the engine's
incremental drafting, position by position.

Loss: soft cross-entropy from the policy's tempered distribution p to the draft's q at
every step, weighted `decay**j`; p is restricted to the draft vocabulary without
renormalising (mass outside it can never be accepted). Metrics per step: top-1 agreement
and the expected acceptance sum_v min(p_v, q_v) of a single draft token, kept on the
device (read once per update by the learner). `draft_loss` is the loss of a padded batch,
the one both offline training (`drafting.train`) and the online learner call.

Cost: step 0 runs over every position (they are the keys of every chain), steps >= 1 only
over anchors from `start` on (the prompt's chains are never scored), and the LM head only
at scored positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specroll.model.kv_cache import KeyChain
from specroll.model.ops import fold_mask

Run = Callable[..., tuple[torch.Tensor | None, torch.Tensor]]
"""run(tokens [B, T'], hidden [B, T', H], unroll=Unroll) -> (_, state [B, T', H])."""


@dataclass
class Unroll:
    """What one TTT step passes to the drafter's layer instead of a KV cache."""

    pos: torch.Tensor
    """[B, T'] RoPE positions t + j of this step's anchors."""
    mask: torch.Tensor
    """[B, 1, g*T', T + j*T'] folded bool mask over the keys of steps 0..j."""
    chain: KeyChain
    """Keys and values of steps 0..j-1 (this step appends its own)."""
    top: int
    """1 + the largest of `pos` (known on the host: it sizes the RoPE tables)."""


def unroll_mask(
    T: int, step: int, start: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[T', T + step*T'] bool for anchors start..T-1 (T' = T - start): step-0 keys causal
    (key s visible to anchor t iff s <= t), step-i keys diagonal (same anchor only)."""
    t = torch.arange(start, T, device=device)
    causal = torch.arange(T, device=device).view(1, -1) <= t.view(-1, 1)  # [T', T]
    if step == 0:
        return causal
    diag = torch.eye(T - start, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


def shift(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, t + n] at index t along dim 1, padded with `fill` at the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_unroll(
    run: Run, feats: torch.Tensor, tokens: torch.Tensor, steps: int, group: int, start: int = 0
) -> list[torch.Tensor]:
    """Drafter states of every step: [B, T, H] for step 0, [B, T - start, H] after.

    feats: [B, T, H] conditioning at anchors t (target features); tokens: [B, T] the
    sequence x_0..x_{T-1} (step j reads x_{t+1+j}); group: query heads per KV head. The
    state of step j at anchor t is read out to predict x_{t+2+j}. With start = 0 and a
    read-out on every position this is the plain unroll.
    """
    B, T = tokens.shape
    dev = tokens.device
    chain = KeyChain()
    hidden, out = feats, []
    for j in range(steps):
        s = 0 if j == 0 else start
        mask = fold_mask(unroll_mask(T, j, s, dev).expand(B, -1, -1), group)
        pos = (torch.arange(s, T, device=dev) + j).expand(B, -1)
        toks = shift(tokens, 1 + j)[:, s:]
        if j == 1 and start:
            hidden = hidden[:, start:]
        _, hidden = run(toks, hidden, unroll=Unroll(pos, mask, chain, T + j))
        out.append(hidden)
    return out


def loss_mask(lengths: torch.Tensor, prompt_lens: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] bool: position i is trained as a target iff its next token is generated
    (i >= prompt_len - 1) and exists (i <= length - 2)."""
    i = torch.arange(T, device=lengths.device).view(1, -1)
    return (i >= prompt_lens.view(-1, 1) - 1) & (i <= lengths.view(-1, 1) - 2)


def ttt_loss(
    states: list[torch.Tensor],
    readout: Callable[[torch.Tensor], torch.Tensor],
    target_logp: torch.Tensor,
    target_index: torch.Tensor,
    decay: float = 0.8,
) -> tuple[torch.Tensor, dict]:
    """Weighted soft cross-entropy over the unrolled steps, and per-step metrics.

    states[j]: [B, T_j, H] from `ttt_unroll` (anchors T - T_j ..); readout: state → draft
    logits [n, V']; target_logp: [n_pos, V'] the policy's log-probs at the scored
    positions over the same vocabulary (restricted, not renormalised); target_index:
    [B, T] row of target_logp for position i, -1 where i is not scored. Step j at anchor
    t is scored against position t + 1 + j.

    Metrics: "ce", "top1", "accept" as fp32 device tensors [steps] (NaN at a step that
    scores nothing) and "count" as host ints. They stay on the device so that the online
    learner reads them once per update, not once per step and micro-batch (a GPU stream
    stall each); the scored positions of every step are found with two host reads in all
    (their count and their indices: the shapes depend on them).
    """
    B, T = target_index.shape
    total = target_logp.new_zeros(())
    rows = [shift(target_index, 1 + j, -1)[:, T - st.shape[1] :] for j, st in enumerate(states)]
    scored = torch.cat([r.flatten() for r in rows]) >= 0
    counts = torch.stack([(r >= 0).sum() for r in rows]).tolist()
    picked = scored.nonzero().squeeze(1)  # every step's scored positions, steps in order
    stats = []
    first, offset = 0, 0
    for j, (st, r, n) in enumerate(zip(states, rows, counts, strict=True)):
        at = picked[first : first + n] - offset  # the positions `r >= 0` selects, in order
        first, offset = first + n, offset + r.numel()
        if n == 0:
            stats.append(torch.full((3,), float("nan"), device=target_logp.device))
            continue
        logp = target_logp[r.flatten()[at]]  # [n, V']
        p = logp.exp()
        logq = F.log_softmax(readout(st.flatten(0, 1)[at]).float(), dim=-1)  # [n, V']
        ce = -(p * logq).sum(-1).mean()
        total = total + decay**j * ce
        with torch.no_grad():
            top1 = (logq.argmax(-1) == logp.argmax(-1)).float().mean()
            accept = torch.minimum(p, logq.exp()).sum(-1).mean()
            stats.append(torch.stack([ce.detach().float(), top1, accept.float()]))
    ce, top1, accept = torch.stack(stats, dim=1)  # [3, steps] → 3 x [steps]
    return total, {"ce": ce, "top1": top1, "accept": accept, "count": counts}


def draft_loss(
    net,  # a TrainableDraft (`drafting.trainable`, which builds on this module)
    tokens: torch.Tensor,
    *,
    aux: torch.Tensor,
    final: torch.Tensor | None,
    lengths: torch.Tensor,
    prompt_lens: torch.Tensor,
    target_logp: Callable[[torch.Tensor], torch.Tensor],
    steps: int,
    decay: float,
    on_device: bool = False,
):
    """TTT loss and per-step metrics of a padded batch (shared by offline and online).

    tokens: [B, T]; aux: [B, T, 3H] target features (detached); final: [B, T, H] the
    target's normed last state (MTP input; unused by EAGLE-3); target_logp(mask [B, T])
    returns the policy's log-probs [n, V'] at the n masked positions over the draft's
    vocabulary (computed without gradient by the caller). Metrics: lists of Python
    numbers per step, read in one transfer (offline training logs them batch by batch);
    with `on_device`, the tensors of `ttt_loss` as they are, for a caller that reads
    them once per update (the online learner).
    """
    T = tokens.shape[1]
    mask = loss_mask(lengths, prompt_lens, T)  # [B, T]
    # each masked position's row in the target (row-major order), -1 elsewhere
    index = torch.where(mask, mask.flatten().cumsum(0).view_as(mask) - 1, -1)
    with torch.no_grad():
        target = target_logp(mask)
    feats = net.features(aux, final)
    start = max(0, int(prompt_lens.min()) - 1 - steps)
    states = ttt_unroll(net.step, feats, tokens, steps, net.kv_group, start)
    loss, metrics = ttt_loss(states, net.readout, target, index, decay)
    if not on_device:
        ce, top1, accept = torch.stack([metrics["ce"], metrics["top1"], metrics["accept"]]).tolist()
        metrics = {"ce": ce, "top1": top1, "accept": accept, "count": metrics["count"]}
    return loss, metrics
