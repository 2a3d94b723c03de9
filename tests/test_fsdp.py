"""The learner on 2 FSDP2 ranks (gloo, local processes) equals the single-process learner:
one update, gradient isolation, whole runs, resume, checkpoints across rank counts, and a
rank that dies."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from specroll.rl.algo import loss as L
from specroll.rl.algo.batch import Batch
from specroll.rl.config import build_config
from specroll.rl.replica import tensors_of
from tests.conftest import make_trainer, step_batch

FSDP = ("learner.strategy=fsdp", "learner.ranks=2")


def _fresh(tiny_setup):
    """A new (policy, tokenizer) of the tiny preset: a run trains its policy in place."""
    from specroll.model import load_model
    from specroll.model.hub import resolve

    return load_model(resolve("tiny")), tiny_setup[1]


def _trainer(setup, tmp_path, *overrides):
    return make_trainer(setup, tmp_path / "run", *overrides)


def _batch(t) -> tuple[Batch, torch.Tensor]:
    """A step's samples with +-1 advantages and old log-probs off by 0.05 (ratios != 1)."""
    batch = step_batch(t, samples=4)
    return batch, t.host.logprobs(batch)[0] - 0.05


def _modules(t):
    """(policy, draft) the single-process host of `t` trains."""
    return t.host.learner.policy, t.host.learner.draft


@pytest.fixture(autouse=True)
def _plain_forwards(monkeypatch):
    """Ranks run every row from its first token; so does the single process they are
    compared with (its shared prompts round differently: tests/test_shared_prompts.py)."""
    from specroll.rl.learner import shared_prompts

    monkeypatch.setattr(shared_prompts, "ENABLED", False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize(
    "overrides",
    [
        ("rollout.drafter=eagle3", "loss.aggregation=token_mean"),
        pytest.param(("rollout.drafter=mtp",), marks=pytest.mark.slow),
    ],
)
def test_two_rank_updates_equal_the_single_process_ones(tiny_setup, tmp_path, overrides):
    """Two updates (policy + online draft) on 3 micro-batches (rank 1 runs a dummy)."""
    from specroll.rl.learner.fsdp.host import FSDPLearnerHost

    over = ("policy.micro_batch=6", *overrides)
    t = _trainer(tiny_setup, tmp_path, *over)
    batch, old = _batch(t)
    policy, draft = _modules(t)
    before = {k: v.clone() for k, v in tensors_of(policy).items()}
    host = FSDPLearnerHost(build_config("tiny", [*over, *FSDP]), policy, draft)
    try:
        lp, _ = host.logprobs(batch)
        assert (lp - (old + 0.05)).abs().max() < 1e-6
        for _ in range(2):
            m1, m2 = t.host.train(batch, old, None), host.train(batch, old, None)
            for k in m1:
                assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
        p2, d2 = host.weights().resolve()
    finally:
        host.close()
    assert _max_diff(before, tensors_of(policy)) > 1e-4  # the updates moved the policy
    assert _max_diff(p2, tensors_of(policy)) < 1e-6
    assert _max_diff(d2, tensors_of(draft)) < 1e-6


def test_bf16_ranks_keep_fp32_master_shards_and_stay_near_one_process(tiny_setup, tmp_path):
    """FSDP2 mixed precision (bf16 compute, fp32 reduction and masters) vs the single
    process's autocast over fp32 masters: the same update to bf16 rounding."""
    from specroll.rl.learner.fsdp.host import FSDPLearnerHost

    t = _trainer(tiny_setup, tmp_path, "learner.dtype=bfloat16")
    batch, old = _batch(t)
    policy, draft = _modules(t)
    host = FSDPLearnerHost(build_config("tiny", ["learner.dtype=bfloat16", *FSDP]), policy, draft)
    try:
        m1, m2 = t.host.train(batch, old, None), host.train(batch, old, None)
        p2, d2 = host.weights().resolve()
    finally:
        host.close()
    for k in ("policy_loss", "draft_loss", "grad_norm", "draft_grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=2e-2), k
    assert all(v.dtype == torch.float32 for v in p2.values() if v.is_floating_point())
    assert _max_diff(p2, tensors_of(policy)) < 5e-3  # an Adam step is lr = 1e-3 per weight


def _nonzero(g: torch.Tensor | None) -> bool:
    """Whether a gradient (a DTensor shard's: gathered, a collective) has a nonzero."""
    if g is None:
        return False
    return int(torch.count_nonzero(g.full_tensor() if hasattr(g, "full_tensor") else g)) > 0


def _isolated(rank, batch: Batch, old: torch.Tensor) -> list[bool]:
    """In every rank, on its FSDP policy: the draft loss of the learner's own forward
    moves no policy shard, the policy loss no draft weight (and each moves its own)."""
    lr = rank.learner
    out = []
    for which in ("draft", "policy"):
        lr.opt.zero_grad(set_to_none=True)
        lr.draft_opt.zero_grad(set_to_none=True)
        logp, target, hidden = lr.forward(lr.policy, batch, lr.draft_vocab())
        if which == "draft":
            loss, _ = lr.draft_loss(batch, hidden, target)
        else:
            pl, _ = L.clipped_objective(logp, old, batch.advantages, 0.2, 0.28)
            loss = L.aggregate(pl, batch.response_mask, "token_mean")
        loss.backward()
        p = [_nonzero(x.grad) for x in lr.policy.parameters()]
        d = [_nonzero(x.grad) for x in lr.draft.parameters()]
        out += [any(p), any(d)]
    return out  # [draft loss: policy moved, draft moved, policy loss: policy, draft]


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_gradient_isolation_under_fsdp(tiny_setup, tmp_path, kind):
    from specroll.rl.learner.fsdp.host import FSDPLearnerHost

    t = _trainer(tiny_setup, tmp_path, f"rollout.drafter={kind}")
    batch, old = _batch(t)
    host = FSDPLearnerHost(build_config("tiny", [f"rollout.drafter={kind}", *FSDP]), *_modules(t))
    try:
        assert host.call(_isolated, batch, old) == [False, True, True, False]
    finally:
        host.close()


def _comparable(m: dict) -> dict:
    timing = ("time", "step_s", "gen_tok_s", "gen_busy_s", "exposed_gen_s")
    checks = ("logprob_check", "logprob_mismatch_mean", "logprob_mismatch_max", "mismatch_kl")
    return {k: v for k, v in m.items() if k not in timing + checks}


def _close(a: list[dict], b: list[dict], tol: float = 1e-5) -> None:
    """The same metrics, floats to `tol` (the sharded sums' order differs)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        x, y = _comparable(x), _comparable(y)
        assert x.keys() == y.keys()
        for k in x:
            floats = isinstance(x[k], float) or (
                isinstance(x[k], list) and x[k] and isinstance(x[k][0], float)
            )
            if floats:
                assert y[k] == pytest.approx(x[k], rel=tol, abs=tol), (x["step"], k)
            else:
                assert y[k] == x[k], (x["step"], k)


def _metrics(tmp_path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _interrupted(setup, tmp_path, *overrides) -> None:
    """A run stopped (as by Ctrl-C) after step 2, its checkpoint saved."""
    t = _trainer(setup, tmp_path, *overrides)

    def stop_after_two(m):
        if m["step"] == 2:
            t.request_stop()

    try:
        with pytest.raises(KeyboardInterrupt):
            t.run(on_step=stop_after_two)
    finally:
        t.close()


def _resumed(setup, tmp_path, *overrides) -> list[dict]:
    t = _trainer(setup, tmp_path, *overrides)
    try:
        t.run(resume=True)
    finally:
        t.close()
    return _metrics(tmp_path)


def test_runs_faults_resumes_and_checkpoints_across_rank_counts(tiny_setup, tmp_path):
    """A 4-step tiny run (checkpoint at step 2): 2 ranks give the single-process metrics.
    A 2-rank run whose rank 1 is killed after step 3 fails step 4 with a message naming
    the rank; resumed from its step-2 checkpoint with 2 ranks, or with one process
    (2 -> 1), it repeats the uninterrupted run, and so does a single-process checkpoint
    resumed with 2 ranks (1 -> 2)."""
    import shutil

    from specroll.rl.errors import LearnerRankError

    single = _trainer(_fresh(tiny_setup), tmp_path / "single")
    full = single.run()
    single.close()
    two = _trainer(_fresh(tiny_setup), tmp_path / "two", *FSDP)
    try:
        _close(full, two.run())
    finally:
        two.close()
    assert (tmp_path / "two" / "run" / "policy" / "config.json").is_file()

    t = _trainer(_fresh(tiny_setup), tmp_path / "a", *FSDP)

    def kill_rank_one(m):
        if m["step"] == 3:
            os.kill(t.host.procs[1].pid, signal.SIGKILL)

    try:
        with pytest.raises(LearnerRankError, match=r"learner rank 1 died .*--resume"):
            t.run(on_step=kill_rank_one)
    finally:
        t.close()
    assert (tmp_path / "a" / "run" / "checkpoints" / "step-000002" / "learner").is_dir()
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    _close(full, _resumed(_fresh(tiny_setup), tmp_path / "a", *FSDP))  # 2 -> 2
    shutil.rmtree(tmp_path / "a")
    (tmp_path / "copy").rename(tmp_path / "a")  # the same run, stopped after step 3
    _close(full, _resumed(_fresh(tiny_setup), tmp_path / "a"))  # 2 -> 1

    _interrupted(_fresh(tiny_setup), tmp_path / "c")
    _close(full, _resumed(_fresh(tiny_setup), tmp_path / "c", *FSDP))  # 1 -> 2


@pytest.mark.slow
def test_a_ten_step_two_rank_run_gives_the_single_process_metrics(tiny_setup, tmp_path):
    a = _trainer(_fresh(tiny_setup), tmp_path / "one", "pipeline.steps=10")
    b = _trainer(_fresh(tiny_setup), tmp_path / "two", "pipeline.steps=10", *FSDP)
    try:
        _close(a.run(), b.run())
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_ray_placed_ranks_give_the_local_ranks_metrics(tiny_setup, tmp_path):
    """Ranks as Ray actors in a placement group (`rollout.backend: ray`): a tiny run with
    the single-process metrics, and a killed rank named."""
    import ray

    from specroll.rl.errors import LearnerRankError

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ray_over = ("rollout.backend=ray", "ray.workers=1", "pipeline.steps=2", *FSDP)
        single = _trainer(_fresh(tiny_setup), tmp_path / "one", "pipeline.steps=2")
        t = _trainer(_fresh(tiny_setup), tmp_path / "two", *ray_over)
        try:
            _close(single.run(), t.run())
            ray.kill(t.host.actors[1], no_restart=True)
            with pytest.raises(LearnerRankError, match="learner rank 1 died"):
                t.host.weights()
        finally:
            single.close()
            t.close()
    finally:
        ray.shutdown()


def test_learner_strategy_and_ranks_are_validated_by_name():
    with pytest.raises(ValueError, match=r"learner.strategy must be one of \('single', 'fsdp'\)"):
        build_config("tiny", ["learner.strategy=ddp"])
    with pytest.raises(ValueError, match="learner.ranks must be an integer >= 1"):
        build_config("tiny", ["learner.strategy=fsdp", "learner.ranks=0"])
    with pytest.raises(ValueError, match="learner.ranks=2 needs learner.strategy=fsdp"):
        build_config("tiny", ["learner.ranks=2"])


def test_the_cli_reports_a_dead_rank_as_an_error(monkeypatch, capsys):
    """`specroll train` ends with the rank's message and exit code 1, not a traceback."""
    import specroll.cli as cli
    from specroll.rl.errors import LearnerRankError

    def dies(args):
        raise LearnerRankError("learner rank 1 died (exit code -9) during 'train'")

    monkeypatch.setattr(cli.train, "cmd_train", dies)
    assert cli.main(["train", "--preset", "tiny"]) == 1
    assert "error: learner rank 1 died" in capsys.readouterr().err


LORA = ("lora.rank=4", "lora.lr=1e-2")


def test_two_rank_lora_updates_equal_the_single_process_ones(tiny_setup, tmp_path):
    """FSDP2 over a LoRA policy (frozen base shards, adapters trained): two updates equal
    the single process's, and a refit gathers only the adapters."""
    from specroll.model import lora
    from specroll.rl.learner.fsdp.host import FSDPLearnerHost

    over = ("policy.micro_batch=6", *LORA)
    t = _trainer(tiny_setup, tmp_path, *over)
    batch, old = _batch(t)
    policy, draft = _modules(t)
    before = {k: v.clone() for k, v in lora.adapters(policy).items()}
    host = FSDPLearnerHost(build_config("tiny", [*over, *FSDP]), policy, draft)
    try:
        for _ in range(2):
            m1, m2 = t.host.train(batch, old, None, 1e-2), host.train(batch, old, None, 1e-2)
            for k in m1:
                assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
        p2, d2 = host.weights().resolve()
    finally:
        host.close()
    assert set(p2) == set(before)  # the adapters, not the base
    assert _max_diff(before, lora.adapters(policy)) > 1e-4
    assert _max_diff(p2, lora.adapters(policy)) < 1e-6
    assert _max_diff(d2, tensors_of(draft)) < 1e-6


def test_a_two_rank_lora_checkpoint_resumes_in_one_process_exactly(tiny_setup, tmp_path):
    """A LoRA run on 2 ranks, stopped after step 2 (a DCP checkpoint of the adapters and
    their optimizer state), resumed in one process: the uninterrupted run's metrics."""
    single = _trainer(_fresh(tiny_setup), tmp_path / "single", *LORA)
    full = single.run()
    single.close()
    _interrupted(_fresh(tiny_setup), tmp_path / "a", *LORA, *FSDP)
    learner_dir = tmp_path / "a" / "run" / "checkpoints" / "step-000002" / "learner"
    assert learner_dir.is_dir()
    _close(full, _resumed(_fresh(tiny_setup), tmp_path / "a", *LORA))
