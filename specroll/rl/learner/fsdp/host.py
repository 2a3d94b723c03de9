"""The learner on N ranks (`learner.strategy: fsdp`, `learner.ranks: N`): one host, N processes.

`FSDPLearnerHost` answers the driver exactly as the single-process host does (the
trainer's loop is unchanged): it spawns N local processes (torch.multiprocessing, spawn) that form
one process group (gloo on the CPU, NCCL with one GPU per rank) and run the same program
(SPMD): every command goes to every rank, each runs its share (`shard`), and rank 0
answers. The ranks are processes of their own, not the driver, so that a rank that dies
cannot take the driver with it: the host sees it gone and fails the step with a message
naming the rank; `--resume` continues from the last checkpoint.

Publishing: the policy is all-gathered parameter by parameter (every rank takes part in
each gather) and rank 0 streams each full tensor to the driver as it comes, so no rank
holds more than its shards and one full parameter.

Checkpoints: `save_sharded` writes the policy, draft and both optimizers with
`torch.distributed.checkpoint` (each rank its shards) into the checkpoint's `learner/`
directory (see `dcp`); such a checkpoint loads with any number of ranks, and into
a single-process learner; a single-process checkpoint loads here too.
"""

from __future__ import annotations

import os
import queue
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from specroll.drafting.trainable import TrainableDraft
from specroll.model.transformer import Transformer
from specroll.model.untrusted import UnreadableFile
from specroll.rl.algo.batch import Batch
from specroll.rl.config import TrainConfig
from specroll.rl.errors import LearnerRankError, NonFiniteError
from specroll.rl.learner.fsdp.rank import serve
from specroll.rl.replica import ReplicaSpec, Weights, tensors_of

POLL_S = 0.5
"""How often the host checks that its ranks are alive while it waits for them."""


def streamed_weights(items: list[tuple[str, str, torch.Tensor]], has_draft: bool) -> Weights:
    """The weights rank 0 streamed, one (module 'policy' | 'draft', name, tensor) at a time."""
    got: dict[str, dict[str, torch.Tensor]] = {"policy": {}, "draft": {}}
    for module, name, t in items:
        got[module][name] = t
    return Weights(got["policy"], got["draft"] if has_draft else None)


class ShardedCheckpoints:
    """What every FSDP host does the same way through its `_call(name, *args)` (rank 0's
    answer): checkpoints are the ranks' own DCP shards, so the driver's state holds none."""

    def _call(self, name: str, *args):
        raise NotImplementedError

    def checkpoint_state(self) -> dict:
        """Nothing full: the learner's state is written by `save_sharded`."""
        return {"learner_strategy": "fsdp"}

    def save_sharded(self, ckpt_dir: Path) -> None:
        """Write the learner's sharded state into `ckpt_dir/learner` (every rank)."""
        self._call("save", str(Path(ckpt_dir) / "learner"))

    def restore(self, state: dict) -> None:
        """From a sharded checkpoint (any rank count) or a single-process one."""
        self._call("load", str(state["path"]), "policy" in state)

    def export(self, out: Path) -> None:
        self._call("export", Path(out))


class FSDPLearnerHost(ShardedCheckpoints):
    """`learner.ranks` learner processes in one FSDP2 process group; rank 0 answers."""

    def __init__(self, cfg: TrainConfig, policy: Transformer, draft: TrainableDraft | None) -> None:
        self.world = cfg.learner.ranks
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="specroll-fsdp-")
        init = os.path.join(self._dir.name, "rendezvous")
        self.results = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(self.world)]
        spec, psd, dsd = ReplicaSpec.of(policy, draft), tensors_of(policy), tensors_of(draft)
        self.procs = []
        for r in range(self.world):
            args = (r, self.world, f"file://{init}", cfg, spec, psd, dsd)
            p = ctx.Process(target=serve, args=(*args, self.cmds[r], self.results), daemon=True)
            p.start()
            self.procs.append(p)
        self.failed: str | None = None
        """Why the host stopped (a rank died or failed); every later call raises it."""
        self._closed = False
        self._collect("start")

    # ------------------------------------------------------------------ plumbing

    def _call(self, name: str, *args, stream: list | None = None):
        """Run command `name` on every rank; rank 0's answer. stream: where rank 0's
        streamed (key, name, tensor) items go (`weights`)."""
        if self.failed:
            raise LearnerRankError(self.failed)
        for q in self.cmds:
            q.put((name, args))
        return self._collect(name, stream)

    def _collect(self, name: str, stream: list | None = None):
        pending, answer, nonfinite, refused = set(range(self.world)), None, None, None
        while pending:
            try:
                kind, rank, value = self.results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive(name)
                continue
            if kind == "item":
                stream.append(value)
            elif kind == "nonfinite":
                pending.discard(rank)
                nonfinite = nonfinite or value
            elif kind == "refused":  # a checkpoint file read as data only: one line
                pending.discard(rank)
                refused = refused or value
            elif kind == "err":
                # a peer's death shows on the survivors as a broken collective: name
                # the dead rank rather than the symptom when there is one
                for r, p in enumerate(self.procs):
                    if r != rank:
                        p.join(timeout=2 * POLL_S)  # give a dying peer time to be seen
                self._check_alive(name)
                self._fail(f"learner rank {rank} failed during {name!r}:\n{value}")
            else:
                pending.discard(rank)
                if rank == 0:
                    answer = value
        if nonfinite is not None:
            raise NonFiniteError(nonfinite)
        if refused is not None:
            raise UnreadableFile(refused)
        return answer

    def _check_alive(self, name: str) -> None:
        for r, p in enumerate(self.procs):
            if p.exitcode is not None:
                self._fail(
                    f"learner rank {r} died (exit code {p.exitcode}) during {name!r}; the "
                    "step did not happen: continue from the last checkpoint with --resume"
                )

    def _fail(self, msg: str) -> None:
        self.failed = msg
        self._stop()
        raise LearnerRankError(msg)

    def _stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)

    # ------------------------------------------------------------------ the host interface

    def logprobs(
        self, batch: Batch, exact: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._call("logprobs", batch, exact)

    def train(
        self, batch: Batch, old: torch.Tensor, ref: torch.Tensor | None, lr: float | None = None
    ) -> dict:
        return self._call("train", batch, old, ref, lr)

    def weights(self) -> Weights:
        """The policy's and draft's full tensors, gathered one at a time and streamed by
        rank 0 (CPU tensors in shared memory)."""
        items: list = []
        has_draft = self._call("weights", stream=items)
        return streamed_weights(items, has_draft)

    def memory(self) -> list[dict]:
        """Each rank's memory figures (`rank_memory`), and resets their peaks."""
        return self._call("memory")

    def call(self, fn, *args):
        """Run `fn(rank_learner, *args)` on every rank (module-level, picklable); rank
        0's result (tests: checks inside the ranks)."""
        return self._call("call", fn, *args)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.failed:
            for q in self.cmds:
                q.put(("close", ()))
            for p in self.procs:
                p.join(timeout=30)
        self._stop()
        self._dir.cleanup()
