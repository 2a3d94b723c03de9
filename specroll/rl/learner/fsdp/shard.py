"""Sharding the learner with PyTorch's FSDP2 (`fully_shard`), and its data parallelism.

Each of the N ranks of one process group (gloo on the CPU, NCCL on GPUs) holds 1/N of
every policy parameter, gradient and AdamW moment: `fully_shard` per decoder block, then
on the whole policy (the embedding, final norm and untied head). A block's parameters are
all-gathered for its forward and again for its backward, and its gradients are
reduce-scattered; nothing here moves a shard by hand.

The draft (a few MB: one layer and a head over the draft vocabulary) is replicated: every
rank holds all of it and its gradients are summed with one all-reduce per parameter, so
it costs no all-gathers in the forward. It reads the policy's embedding (and MTP its head)
while the policy's root is unsharded after its forward, through `detach()` as in one
process: cross-gradients stay exactly zero.

Data parallelism that equals one process: every rank receives the whole batch, plans the
same micro-batches as one process would and runs every N-th of them (`DataParallel.share`,
padded with dummy micro-batches so that all ranks run as many collectives). Each micro-
batch's loss is its share of the global aggregate (token-level: divided by the global
token count, all-reduced), gradients are summed over ranks (not averaged: FSDP's divide
factor is 1), and clipping uses the global norm, so the update is the single-process one
up to float summation order.

Mixed precision: with `learner.dtype: bfloat16`, FSDP2's `MixedPrecisionPolicy` gathers
bf16 parameters for compute and reduces gradients in fp32 onto fp32 master shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specroll.model import lora
from specroll.model.transformer import Transformer


@dataclass
class DataParallel:
    """This rank's place in the learner's process group."""

    rank: int
    """This process's rank (0 answers the driver)."""
    world: int
    """Ranks in the group."""

    def share(self, plan: list) -> list[tuple[object, bool]]:
        """This rank's micro-batches of `plan` (every `world`-th, from `rank`) as (micro,
        True), then (plan[0], False) dummies up to the most any rank runs."""
        mine = [(m, True) for m in plan[self.rank :: self.world]]
        most = -(-len(plan) // self.world)
        return mine + [(plan[0], False)] * (most - len(mine))

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place maximum over ranks."""
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def token_count(self, mask: torch.Tensor, rows: list[list[int]]) -> float:
        """The global count of response tokens: this rank's micro-batches' rows of `mask`
        [N, T], summed over ranks (at least 1, as in one process)."""
        idx = [i for r in rows for i in r]
        n = mask[torch.tensor(idx, dtype=torch.long, device=mask.device)].sum().double()
        return float(self.sum_(n.reshape(1)).clamp(min=1))

    def sum_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum a replicated module's gradients over ranks (a rank without one adds 0)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.sum_(p.grad)


def shard_policy(policy: Transformer, dtype: torch.dtype, mesh=None) -> Transformer:
    """`fully_shard` each decoder block, then the root (embedding, final norm, untied head),
    in place; gradients summed over ranks (the loss is already a share of the global
    aggregate). bf16: bf16 compute, fp32 reduction and master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict = {"mesh": mesh} if mesh is not None else {}
    if dtype == torch.bfloat16:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in policy.layers:
        fully_shard(block, **kw)
    fully_shard(policy, **kw)
    for m in policy.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            # a plain SUM (gloo has no pre-multiplied sum; the factor 1 divides nothing)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return policy


def full_tensors(module: torch.nn.Module | None, adapters_only: bool = False):
    """(name, full tensor) of `module`'s state, one at a time: a shard is all-gathered
    (a collective: every rank iterates), a replicated tensor is yielded as it is.
    adapters_only: a LoRA policy's adapters alone (a refit: the base never changes)."""
    if module is None:
        return
    for name, t in module.state_dict().items():
        if adapters_only and not lora.is_adapter(name):
            continue
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t.detach())
