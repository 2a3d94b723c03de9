"""A run starts at once (issue 47): with an empty cache it samples nothing, trains no
draft and measures no full profile before its first step; its draft (started without
sampling) trains online from step 1 and its depth policy calibrates online; and a
resumed run continues both exactly — the draft's weights and the depth policy's
acceptance counts, time calibration and cost model — so its metrics equal the
uninterrupted run's."""

from __future__ import annotations

import itertools
import json
import os
import types

import pytest
import torch

from tests.conftest import make_trainer, train_tiny

ADAPTIVE = ("rollout.depth=adaptive", "draft.init=auto", "data.pool=4")
"""The tiny preset as the default one runs: adaptive depth, the draft `auto` picks."""
CLOCKED = ("engine", "iteration", "forms", "profile", "graphs")
"""The modules of `specroll.engine` that read the clock."""


def _spy_profiles(monkeypatch) -> list[dict]:
    """Every profile measured: the grid it was asked for."""
    from specroll.engine import profile as P

    grids, real = [], P.profile

    def spy(model, drafter, prompts, **kw):
        grids.append({k: v for k, v in kw.items() if k != "log"})
        return real(model, drafter, prompts, **kw)

    monkeypatch.setattr(P, "profile", spy)
    return grids


def _no_offline_build(monkeypatch) -> None:
    from specroll.drafting import default

    def refuse(*a, **kw):
        raise AssertionError("the in-domain draft was built before the first step")

    monkeypatch.setattr(default, "collect", refuse)
    monkeypatch.setattr(default, "train_draft", refuse)


def test_an_empty_cache_samples_nothing_and_profiles_nothing_before_step_one(
    home, tmp_path, monkeypatch
):
    """`specroll train` with adaptive depth and `draft.init: auto` on an empty cache: no
    policy sampling, no draft training, only the quick profile (seconds); the draft
    trains online from step 1."""
    _no_offline_build(monkeypatch)
    grids = _spy_profiles(monkeypatch)
    from specroll.engine.profile import QUICK

    sets = [x for s in ADAPTIVE for x in ("--set", s)]
    assert train_tiny(tmp_path / "run", *sets, "--steps", "2") == 0
    assert grids == [QUICK]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if "reward" in json.loads(x)]  # (not step 0's val)
    assert [m["step"] for m in steps] == [1, 2]
    assert all(len(m["draft_accept"]) == 3 for m in steps)  # trained online, TTT of 3


def test_auto_takes_the_cached_in_domain_draft_when_there_is_one(home, tiny_setup):
    """`auto` loads a draft `draft.init: offline` built earlier for this policy and task
    (here: one saved where that build caches it) instead of starting a fresh one."""
    from specroll.drafting.default import _place, cached_draft
    from specroll.drafting.trainable import save_draft
    from specroll.model.hub import resolve
    from specroll.rl.config import build_config
    from specroll.rl.run.draft import build_draft

    policy, tok = tiny_setup
    cfg = build_config("tiny", ["draft.init=auto"])
    assert cached_draft(resolve("tiny"), "eagle3") is None
    fresh = build_draft(cfg, policy, tok, resolve("tiny"))
    with torch.no_grad():
        fresh.fc.mul_(3.0)  # weights no fresh start has
    save_draft(fresh, _place(resolve("tiny"), None, "eagle3", None)[1] / "draft")
    assert cached_draft(resolve("tiny"), "eagle3") is not None
    loaded = build_draft(cfg, policy, tok, resolve("tiny"))
    assert torch.equal(loaded.fc, fresh.fc)


@pytest.mark.parametrize("start", ["policy", "random"])
def test_a_fresh_draft_reads_its_vocabulary_from_the_policy_on_the_prompts(tiny_setup, start):
    """Both starts keep the ids the policy expects most on the prompts (no sampling),
    and differ in the layer: 'policy' copies the policy's last one."""
    from specroll.drafting.fresh import fresh_draft, prompt_vocab

    policy, _ = tiny_setup
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    head = fresh_draft(start, "eagle3", policy, prompts, seed=0, vocab_size=16)
    ids = torch.arange(16) + head.d2t
    assert torch.equal(ids, prompt_vocab(policy, prompts, 16))
    with torch.no_grad():
        logits = policy(torch.tensor([prompts[0]])).logits[0].softmax(-1).sum(0)
    top = set(logits.topk(4).indices.tolist())
    assert top <= set(ids.tolist())  # the four most expected ids are in
    last = policy.layers[-1]
    copied = torch.equal(head.w_down, last.w_down) and torch.equal(head.wo, last.wo)
    assert copied == (start == "policy")


def _counter_clock(monkeypatch) -> None:
    """Every clock read in the engine advances by one microsecond: iteration times (and
    so adaptive depth's choices and the quick profile) are a function of the code path
    alone, the same in every process."""
    import importlib

    tick = itertools.count()
    clock = types.SimpleNamespace(perf_counter=lambda: next(tick) * 1e-6)
    for name in CLOCKED:
        monkeypatch.setattr(importlib.import_module(f"specroll.engine.{name}"), "time", clock)


def _comparable(m: dict) -> dict:
    """A step's metrics without wall-clock figures and the agreement checks (when those
    ran changes what was measured, never what was trained)."""
    timing = ("time", "step_s", "gen_tok_s", "gen_busy_s", "exposed_gen_s")
    checks = ("logprob_check", "logprob_mismatch_mean", "logprob_mismatch_max", "mismatch_kl")
    return {k: v for k, v in m.items() if k not in timing + checks}


def _interrupted_and_resumed(setup, out, overrides) -> list[dict]:
    from specroll.model import load_model
    from specroll.model.hub import resolve

    def fresh():
        return make_trainer((load_model(resolve("tiny")), setup[1]), out, *overrides)

    t = fresh()

    def stop_after_two(m):
        if m["step"] == 2:
            t.request_stop()

    with pytest.raises(KeyboardInterrupt):
        t.run(on_step=stop_after_two)
    fresh().run(resume=True)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_continues_the_online_draft_and_calibration_exactly(
    home, tiny_setup, tmp_path, monkeypatch
):
    """Interrupted after step 2 and resumed: every metric of every step equals the
    uninterrupted run's — the tokens sampled, the draft's acceptance and online
    training, the depths chosen. The control: the same resume with the depth policy's
    state not restored samples the same rewards' distribution but drafts differently."""
    from specroll.engine.depth import AdaptiveDepth
    from specroll.model import load_model
    from specroll.model.hub import resolve

    _counter_clock(monkeypatch)
    overrides = (*ADAPTIVE, "pipeline.steps=4", "pipeline.checkpoint_every=1")
    setup = (load_model(resolve("tiny")), tiny_setup[1])
    full = make_trainer(setup, tmp_path / "a" / "run", *overrides).run()
    drafted = [sum(m.get("depth_hist", [0])[1:]) for m in full]
    assert sum(drafted) > 0, drafted  # the depth policy did draft
    resumed = _interrupted_and_resumed(tiny_setup, tmp_path / "b" / "run", overrides)
    assert [_comparable(m) for m in resumed] == [_comparable(m) for m in full]

    monkeypatch.setattr(AdaptiveDepth, "load_state_dict", lambda self, state: None)
    control = _interrupted_and_resumed(tiny_setup, tmp_path / "c" / "run", overrides)
    assert [_comparable(m) for m in control[2:]] != [_comparable(m) for m in full[2:]]


def test_profile_measure_measures_the_full_profile_once_and_caches_it(
    home, tiny_setup, monkeypatch
):
    """`rollout.profile: measure` is the way back to the full profile before the first
    step: measured on the full grid, cached, and taken from the cache by the next run
    (as is a full profile `specroll bench profile` or an earlier run left)."""
    from specroll.engine import profile as P
    from specroll.engine.costmodel import CostModel
    from specroll.model.hub import resolve
    from specroll.rl.config import build_config
    from specroll.rl.rollout.local import build_engine
    from specroll.rl.run.draft import build_draft

    grids = []

    def fake(model, drafter, prompts, **kw):  # a measurement in no time
        grids.append({k: v for k, v in kw.items() if k != "log"})
        return CostModel(fixed=1e-3, per_token=1e-4, meta={"format": P.FORMAT})

    monkeypatch.setattr(P, "profile", fake)
    policy, tok = tiny_setup
    cfg = build_config("tiny", ["rollout.depth=adaptive", "rollout.profile=measure"])
    draft = build_draft(cfg, policy, tok, resolve("tiny"))
    build_engine(cfg.rollout, policy, draft, [[1, 2, 3, 4]], log=lambda m: None)
    assert grids == [{}]  # the full grid (`profile`'s defaults), then cached
    quick = build_config("tiny", ["rollout.depth=adaptive"])
    engine = build_engine(quick.rollout, policy, draft, [[1, 2, 3, 4]], log=lambda m: None)
    assert grids == [{}]  # the cached one: nothing measured again
    assert engine.depth.cost.meta["cache_path"].startswith(os.environ["SPECROLL_HOME"])
