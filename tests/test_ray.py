"""The Ray placement: same results as in-process, bounded lag when asynchronous, no lost
or duplicated samples when a rollout worker dies, checkpoint/resume."""

from __future__ import annotations

import json

import pytest
import torch

from specroll.rl.config import build_config
from tests.conftest import make_trainer

TIMING = ("time", "step_s", "gen_tok_s", "gen_busy_s", "exposed_gen_s")


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    from specroll.model.hub import resolve

    return resolve("tiny")


def _setup(tiny_dir):
    from specroll.model import load_model
    from specroll.model.tokenizer import Tokenizer

    return load_model(tiny_dir), Tokenizer(tiny_dir)


def _trainer(tiny_dir, out, *overrides):
    over = ("data.val_size=0", "pipeline.steps=3", *overrides)
    return make_trainer(_setup(tiny_dir), out, *over)


CHECK = ("logprob_check", "logprob_mismatch_mean", "logprob_mismatch_max", "mismatch_kl")


def _same(a: dict, b: dict) -> None:
    """Equal metrics: tokens, lengths, versions exactly; losses to float rounding (a
    worker's GEMMs see other batch shapes than the in-process engine's). depth_hist counts
    decode forwards, which depend on how rows are split across workers. The log-prob
    agreement check runs on the first step of every process, so a resumed run checks a step
    the uninterrupted one did not (a passed check still trains on the engine's log-probs)."""
    assert a.keys() == b.keys()
    for k in a:
        if k in TIMING or k in ("worker_restarts", "depth_hist", *CHECK):
            continue
        floats = isinstance(a[k], list) and a[k] and isinstance(a[k][0], float)
        if isinstance(a[k], float) or floats:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
        else:
            assert a[k] == b[k], k


def test_async_respects_max_lag(local_ray, tiny, tmp_path):
    t = _trainer(tiny, tmp_path, "rollout.backend=ray", "pipeline.max_lag=1", "pipeline.steps=4")
    seen = []
    generate = t.rollout.submit

    def spy(reqs):
        pending = generate(reqs)
        seen.append((t.step, pending.version))  # learner step at submission, weights
        return pending

    t.rollout.submit = spy
    try:
        rows = [t.run_step() for _ in range(4)]
    finally:
        t.close()
    for m in rows:
        assert set(m["lag"]) <= {"0", "1"} and sum(m["lag"].values()) == 16, m["lag"]
        assert m["dropped_samples"] == 0
    assert any("1" in m["lag"] for m in rows)  # generation did run ahead of the learner
    assert all(v == s for s, v in seen)  # submitted with the weights current at the time
    with pytest.raises(ValueError, match="pipeline.max_lag"):
        build_config("tiny", ["pipeline.max_lag=-1"])


def test_a_killed_worker_loses_and_duplicates_nothing(local_ray, tiny, tmp_path):
    t = _trainer(tiny, tmp_path, "rollout.backend=ray", "ray.workers=2")
    reqs = t.task.step_requests(0)
    try:
        expected = t.rollout.generate(reqs)  # the same weights, no failure
        pending = t.rollout.submit(reqs)
        local_ray.kill(t.rollout.workers[0], no_restart=True)  # mid-step
        results = pending.result()
        assert t.rollout.restarts == 1
        assert [r.token_ids for r in results] == [r.token_ids for r in expected]
        assert results.stats.emitted_tokens > 0
        m = t.run_step()  # the replacement worker serves the next step
        assert m["worker_restarts"] == 1 and sum(m["lag"].values()) == len(reqs)
    finally:
        t.close()


def test_a_worker_refuses_a_draft_of_another_shape(local_ray, tiny, tmp_path):
    from specroll.drafting.data import default_aux_layers
    from specroll.drafting.train import new_eagle3
    from specroll.rl.replica import Weights

    t = _trainer(tiny, tmp_path, "rollout.backend=ray", "ray.workers=1")
    try:
        policy, _ = _setup(tiny)
        other = new_eagle3(policy, torch.arange(32), default_aux_layers(policy), 0)
        t.rollout.update_weights(1, Weights.of(policy, other))
        with pytest.raises(Exception, match="lm_head"):
            t.rollout.generate(t.task.step_requests(0))
    finally:
        t.close()


def test_sync_on_ray_gives_the_single_process_metrics_and_resumes_exactly(
    local_ray, tiny, tmp_path
):
    """A 3-step run on Ray (2 rollout workers), stopped after step 2 and resumed from its
    checkpoint by a new trainer: every step's metrics, before and after the resume, are
    those of the same run in process."""
    rows = _trainer(tiny, tmp_path / "a", "pipeline.checkpoint_every=1").run()
    over = ("rollout.backend=ray", "ray.workers=2", "pipeline.checkpoint_every=1")
    t = _trainer(tiny, tmp_path / "b", *over)

    def stop_after_two(m):
        if m["step"] == 2:
            t.request_stop()

    try:
        with pytest.raises(KeyboardInterrupt):
            t.run(on_step=stop_after_two)
    finally:
        t.close()
    resumed = _trainer(tiny, tmp_path / "b", *over)
    try:
        resumed.run(resume=True)
    finally:
        resumed.close()
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [r["step"] for r in rows]
    for a, b in zip([json.loads(x) for x in lines], rows, strict=True):
        _same(a, b)


def test_resources_that_cannot_fit_fail_fast(local_ray, tiny, tmp_path):
    with pytest.raises(ValueError, match="ray.workers"):
        _trainer(tiny, tmp_path, "rollout.backend=ray", "ray.workers=3")


def test_a_lora_run_on_ray_gives_the_in_process_metrics(local_ray, tiny, tmp_path):
    """A LoRA policy on Ray: the learner actor publishes only the adapters, the workers
    build on the base put into the object store once and serve them (merged); every
    step's metrics are those of the same run in process."""
    over = ("lora.rank=4", "lora.lr=1e-2")
    rows = _trainer(tiny, tmp_path / "a", *over).run()
    t = _trainer(tiny, tmp_path / "b", *over, "rollout.backend=ray", "ray.workers=2")
    try:
        ray_rows = t.run()
        assert set(t.host.weights().resolve()[0]) == {
            k for k in t.checkpoint_state()["policy"] if ".lora." in k
        }
    finally:
        t.close()
    for a, b in zip(ray_rows, rows, strict=True):
        _same(a, b)


def test_a_worker_restarted_mid_run_builds_on_the_frozen_draft(local_ray, tiny, tmp_path):
    """draft.online=false: refits after the first carry no draft, so a worker that
    replaces a dead one must build on the draft published first; the run's metrics are
    those of the same run in process."""
    over = ("draft.online=false", "lora.rank=4", "lora.lr=1e-2")
    rows = _trainer(tiny, tmp_path / "a", *over).run()
    t = _trainer(tiny, tmp_path / "b", *over, "rollout.backend=ray", "ray.workers=2")
    try:
        ray_rows = [t.run_step()]
        local_ray.kill(t.rollout.workers[0], no_restart=True)
        ray_rows += [t.run_step(), t.run_step()]
        assert t.rollout.restarts == 1 and ray_rows[-1]["acceptance_length"]
    finally:
        t.close()
    for a, b in zip(ray_rows, rows, strict=True):
        _same(a, b)
