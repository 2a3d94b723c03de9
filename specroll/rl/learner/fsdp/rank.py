"""One learner rank of an FSDP host: its shard of the policy, a replica of the draft.

Every rank runs every command (each is a sequence of collectives); only rank 0's return
value reaches the driver. See `shard` for the sharding and the data parallelism; `serve`
is the loop of a rank in a local process (`host`), `ray.RankActor` its Ray twin.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from specroll.device import resolve_dtype
from specroll.drafting.trainable import save_draft
from specroll.model import peft_io
from specroll.model.untrusted import UnreadableFile, load_tensors
from specroll.model.weights import save_model
from specroll.rl.algo.batch import Batch
from specroll.rl.config import TrainConfig
from specroll.rl.errors import NonFiniteError
from specroll.rl.learner.build import build_learner, learner_device
from specroll.rl.learner.fsdp import dcp
from specroll.rl.learner.fsdp.shard import DataParallel, full_tensors, shard_policy
from specroll.rl.replica import ReplicaSpec, State


class RankLearner:
    """The learner as one rank of the process group runs it."""

    def __init__(
        self,
        rank: int,
        world: int,
        init: str,
        cfg: TrainConfig,
        spec: ReplicaSpec,
        policy_state: State,
        draft_state: State | None,
    ) -> None:
        self.rank, self.world, self.cfg = rank, world, cfg
        threads = os.environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // world))
        torch.manual_seed(cfg.pipeline.seed)
        device = learner_device(cfg.learner, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=init,
            rank=rank,
            world_size=world,
        )
        dtype = resolve_dtype(cfg.learner.dtype, "learner.dtype")
        policy = spec.policy(policy_state)
        policy.to(device).for_training()
        draft = spec.draft(policy, draft_state)  # references the policy's embedding (and head)
        self.policy, self.draft, self.spec = policy, draft, spec
        shard = lambda model: shard_policy(model, dtype)  # noqa: E731
        self.learner = build_learner(cfg, policy, draft, device, prepare=shard)
        self.learner.dp = DataParallel(rank, world)

    def logprobs(
        self, batch: Batch, exact: bool, emit: Callable
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(FSDP's mixed precision gathers bf16 shards: `exact` cannot undo that, and
        `algo.old_logprobs` never asks it of a sharded learner.)"""
        lr = self.learner
        return lr.logprobs(batch, exact=exact), lr.reference_logprobs(batch)

    def train(self, batch: Batch, old, ref, lr: float | None, emit: Callable) -> dict:
        return self.learner.train(batch, old, ref, lr=lr)

    def weights(self, emit: Callable) -> bool:
        """Gather the policy one tensor at a time; rank 0 streams each (as a CPU tensor)
        and drops it before the next gather. Whether there is a draft."""
        adapted = self.spec.lora is not None
        for key, module in (("policy", self.policy), ("draft", self.draft)):
            for name, t in full_tensors(module, adapters_only=adapted and key == "policy"):
                if self.rank == 0:
                    emit(("item", 0, (key, name, t.cpu())))
                del t
        return self.draft is not None

    def save(self, path: str, emit: Callable) -> None:
        dcp.save(self.learner, self.draft, path)

    def load(self, ckpt: str, full: bool, emit: Callable) -> None:
        """From checkpoint directory `ckpt`: its `learner/` (DCP), or (`full`) the
        single-process state in its `state.pt` (every rank reads it, memory-mapped). Both
        are read as data: a file that asks to run code is refused (`UnreadableFile`)."""
        if full:
            state = load_tensors(Path(ckpt) / "state.pt", mmap=True)
            dcp.load_full(self.learner, self.draft, state)
        else:
            dcp.load(self.learner, self.draft, Path(ckpt) / "learner")

    def export(self, out: Path, emit: Callable) -> None:
        """Rank 0 saves the full policy (gathered tensor by tensor into a plain model;
        a LoRA policy's adapters merged, and as a PEFT adapter/ beside it) and the draft."""
        plain = self.spec.policy() if self.rank == 0 else None
        tensors = plain.state_dict() if plain is not None else {}
        for name, t in full_tensors(self.policy):
            if plain is not None:
                tensors[name].copy_(t)  # into the plain model's own tensor
        if plain is not None:
            save_model(plain, out / "policy")
            if plain.lora_spec is not None:
                peft_io.save(plain, out / "adapter", peft_io.base_of(self.cfg.policy.model))
            if self.draft is not None:
                save_draft(self.draft, out / "draft")

    def call(self, fn: Callable, *args, emit: Callable):
        """`fn(self, *args)` (see `host.FSDPLearnerHost.call`)."""
        return fn(self, *args)

    def memory(self, emit: Callable) -> list[dict] | None:
        """Every rank's `rank_memory()` (rank 0 answers with all of them)."""
        mine = [None] * self.world
        dist.all_gather_object(mine, {"rank": self.rank, **rank_memory()})
        return mine

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_memory() -> dict:
    """This process's peak resident memory since the last call (VmHWM, reset through
    /proc/self/clear_refs) and, on a GPU, its peak allocated CUDA memory, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                k, v = line.split(":")
                out[k.lower() + "_mib"] = round(int(v.split()[0]) / 1024, 1)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    return out


def serve(rank, world, init, cfg, spec, policy_state, draft_state, cmds, results) -> None:
    """A rank's loop: build its shard of the learner, then run the driver's commands."""
    try:
        worker = RankLearner(rank, world, init, cfg, spec, policy_state, draft_state)
        del policy_state, draft_state
    except Exception:
        results.put(("err", rank, traceback.format_exc()))
        return
    results.put(("ok", rank, None))
    while True:
        name, args = cmds.get()
        if name == "close":
            break
        try:
            value = getattr(worker, name)(*args, emit=results.put)
            results.put(("ok", rank, value if rank == 0 else None))
        except NonFiniteError as e:  # every rank skipped the same update: still in step
            results.put(("nonfinite", rank, str(e)))
        except UnreadableFile as e:  # every rank refused the same checkpoint file
            results.put(("refused", rank, str(e)))
        except Exception:
            results.put(("err", rank, traceback.format_exc()))
            break
    worker.close()
