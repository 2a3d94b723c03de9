"""One learner rank of `FSDPLearnerHost`: its shard of the policy, a replica of the draft.

Every rank runs every command (each is a sequence of collectives); only rank 0's return
value reaches the driver. See `rl.fsdp` for the sharding and the data parallelism.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from specroll.device import resolve_dtype
from specroll.model.transformer import Transformer
from specroll.rl import dcp_state
from specroll.rl.batch import Batch
from specroll.rl.config import TrainConfig
from specroll.rl.fsdp import DataParallel, full_tensors, shard_policy
from specroll.rl.learner_host import build_learner


def _device(cfg: TrainConfig, rank: int) -> torch.device:
    """learner.device for rank `rank`: 'auto' and 'cuda' mean this rank's GPU."""
    name = cfg.learner.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


class RankLearner:
    """The learner as one rank of the process group runs it."""

    def __init__(self, rank, world, init, cfg: TrainConfig, model_cfg, dspec, psd, dsd) -> None:
        self.rank, self.world, self.cfg = rank, world, cfg
        threads = os.environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // world))
        torch.manual_seed(cfg.pipeline.seed)
        device = _device(cfg, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=init,
            rank=rank,
            world_size=world,
        )
        dtype = resolve_dtype(cfg.learner.dtype, "learner.dtype")
        policy = Transformer(model_cfg)
        policy.load_state_dict(psd)
        policy.to(device).for_training()
        draft = None
        if dspec is not None:
            cls, draft_cfg = dspec
            draft = cls(draft_cfg, policy)  # references the policy's embedding (and head)
            draft.load_state_dict(dsd)
        self.policy, self.draft, self.model_cfg = policy, draft, model_cfg
        shard = lambda model: shard_policy(model, dtype)  # noqa: E731
        self.learner = build_learner(cfg, policy, draft, device, prepare=shard)
        self.learner.dp = DataParallel(rank, world)

    def logprobs(self, batch: Batch, emit: Callable) -> tuple[torch.Tensor, torch.Tensor | None]:
        lr = self.learner
        ref = lr.logprobs(batch, lr.reference) if lr.reference is not None else None
        return lr.logprobs(batch), ref

    def train(self, batch: Batch, old, ref, emit: Callable) -> dict:
        return self.learner.train(batch, old, ref)

    def weights(self, emit: Callable) -> bool:
        """Gather the policy one tensor at a time; rank 0 streams each (as a CPU tensor)
        and drops it before the next gather. Whether there is a draft."""
        for key, module in (("policy", self.policy), ("draft", self.draft)):
            for name, t in full_tensors(module):
                if self.rank == 0:
                    emit(("item", 0, (key, name, t.cpu())))
                del t
        return self.draft is not None

    def save(self, path: str, emit: Callable) -> None:
        dcp_state.save(self.learner, self.draft, path)

    def load(self, ckpt: str, full: bool, emit: Callable) -> None:
        """From checkpoint directory `ckpt`: its `learner/` (DCP), or (`full`) the
        single-process state in its `state.pt` (every rank reads it, memory-mapped)."""
        if full:
            state = torch.load(Path(ckpt) / "state.pt", weights_only=False, mmap=True)
            dcp_state.load_full(self.learner, self.draft, state)
        else:
            dcp_state.load(self.learner, self.draft, Path(ckpt) / "learner")

    def export(self, out: Path, emit: Callable) -> None:
        """Rank 0 saves the full policy (gathered tensor by tensor into a plain model)
        and the draft."""
        from specroll.model.weights import save_model

        plain = Transformer(self.model_cfg) if self.rank == 0 else None
        tensors = plain.state_dict() if plain is not None else {}
        for name, t in full_tensors(self.policy):
            if plain is not None:
                tensors[name].copy_(t)  # into the plain model's own tensor
        if plain is not None:
            save_model(plain, out / "policy")
            if self.draft is not None:
                self.draft.save(out / "draft")

    def call(self, fn: Callable, *args, emit: Callable):
        """`fn(self, *args)` (see `FSDPLearnerHost.call`)."""
        return fn(self, *args)

    def memory(self, emit: Callable) -> list[dict] | None:
        """Every rank's `rank_memory()` (rank 0 answers with all of them)."""
        from specroll.rl.fsdp_host import rank_memory

        mine = [None] * self.world
        dist.all_gather_object(mine, {"rank": self.rank, **rank_memory()})
        return mine

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
