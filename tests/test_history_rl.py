"""The history drafter in the RL loop: `rollout.drafter`, its store saved with
checkpoints and restored, so that an interrupted and resumed run drafts — and so
samples — exactly as the uninterrupted one; the store alone round-trips."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from specroll.drafters import history as history_module
from specroll.drafters.history import HistoryDrafter
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.rl.config import build_config
from tests.conftest import PROMPT, make_trainer, spec_model

HISTORY = ("rollout.drafter=history", "rollout.k=8", "data.pool=4")
"""The tiny preset drafting from history, its 4 prompts recurring every step."""


def _comparable(m: dict) -> dict:
    """A step's metrics without its wall-clock figures and the agreement checks (when those
    ran changes what was measured, never what was trained)."""
    timing = ("time", "step_s", "gen_tok_s", "gen_busy_s", "exposed_gen_s")
    checks = ("logprob_check", "logprob_mismatch_mean", "logprob_mismatch_max", "mismatch_kl")
    return {k: v for k, v in m.items() if k not in timing + checks}


def _spec_fields(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if "accept" in k or "draft" in k} for m in metrics]


@pytest.mark.parametrize("drafter", ["history", "history+eagle3"])
def test_a_resumed_run_drafts_from_the_history_the_interrupted_one_saved(
    tiny_setup, tmp_path, drafter, monkeypatch
):
    """Drafting is a function of the store (and the network's weights): bit for bit. The
    combined drafter's form is held at the merged tree here, since which form fills a
    budget reads wall time (`engine.forms`); its figures' checkpoint is tested in
    `tests/test_combined.py`."""
    from specroll.engine.forms import FormChoice
    from specroll.model import load_model
    from specroll.model.hub import resolve

    monkeypatch.setattr(FormChoice, "choose", lambda self, k: "merged")
    overrides = (*HISTORY, f"rollout.drafter={drafter}")
    full = make_trainer(tiny_setup, tmp_path / "a" / "run", *overrides).run()
    assert any(m["acceptance_length"] > 1 for m in full[1:]), full[1]

    def fresh(out: str):
        return make_trainer((load_model(resolve("tiny")), tiny_setup[1]), out, *overrides)

    t = fresh(tmp_path / "b" / "run")

    def stop_after_two(m):
        if m["step"] == 2:
            t.request_stop()

    with pytest.raises(KeyboardInterrupt):
        t.run(on_step=stop_after_two)
    fresh(tmp_path / "b" / "run").run(resume=True)
    lines = (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    resumed = [json.loads(x) for x in lines]
    assert [_comparable(m) for m in resumed] == [_comparable(m) for m in full]


def test_a_resume_without_the_history_drafts_differently(tiny_setup, tmp_path, monkeypatch):
    """The control: the same resume with the store not restored samples the same tokens
    (speculation is lossless) but drafts differently — the restored store is what made
    the resumed run's drafting statistics equal."""
    from specroll.model import load_model
    from specroll.model.hub import resolve
    from specroll.rl.rollout.local import LocalRollout

    full = make_trainer(tiny_setup, tmp_path / "a" / "run", *HISTORY).run()
    t = make_trainer((load_model(resolve("tiny")), tiny_setup[1]), tmp_path / "b" / "run", *HISTORY)

    def stop_after_two(m):
        if m["step"] == 2:
            t.request_stop()

    with pytest.raises(KeyboardInterrupt):
        t.run(on_step=stop_after_two)
    monkeypatch.setattr(LocalRollout, "load_drafter_state", lambda self, state: None)
    r = make_trainer((load_model(resolve("tiny")), tiny_setup[1]), tmp_path / "b" / "run", *HISTORY)
    r.run(resume=True)
    lines = (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    resumed = [json.loads(x) for x in lines]
    assert [m.get("response_lengths") for m in resumed] == [m.get("response_lengths") for m in full]
    assert _spec_fields(resumed[2:]) != _spec_fields(full[2:])


def test_the_history_store_round_trips(tmp_path, monkeypatch):
    """Save after two calls (siblings, finished rollouts, the cross-prompt window), load
    into a fresh drafter: the next call proposes, accepts and samples identically."""
    target = spec_model(0)
    prompts = [PROMPT, PROMPT[:3], PROMPT[1:]]

    def requests(seed0: int) -> list[Request]:
        params = [
            SamplingParams(1.0, max_new_tokens=24, stop_token_ids=(), seed=seed0 + i)
            for i in range(24)
        ]
        return [Request(prompts[i % 3], p) for i, p in enumerate(params)]

    for name, bound in (("PAST", 4), ("WINDOW", 8), ("PROMPTS", 2)):  # every bound is reached
        monkeypatch.setattr(history_module, name, bound)
    a = HistoryDrafter()
    eng = Engine(target, EngineConfig(max_batch=8), a, FixedDepth(8))
    for seed0 in (100, 200):
        eng.generate(requests(seed0))
    reqs = requests(0)
    b = HistoryDrafter()
    b.load_state_dict(a.state_dict())
    assert b.state_dict().keys() == a.state_dict().keys()
    out = []
    for drafter in (a, b):
        e = Engine(target, EngineConfig(max_batch=8), drafter, FixedDepth(8))
        res = e.generate(reqs)
        out.append(([r.token_ids for r in res], e.stats.accepted_tokens, e.stats.draft_nodes))
    assert out[0] == out[1]
    assert out[0][1] > 0


def test_rollout_drafter_settings_are_checked():
    with pytest.raises(ValueError, match=r"rollout.drafter must be one of"):
        build_config("tiny", ["rollout.drafter=suffix"])
    for old, new in (("draft", "eagle3 or mtp"), ("history+draft", r"history\+eagle3 or")):
        with pytest.raises(ValueError, match=rf"drafter={re.escape(old)} is retired: .* {new}"):
            build_config("tiny", [f"rollout.drafter={old}"])
    with pytest.raises(ValueError, match=r"draft.kind is retired: set rollout.drafter"):
        build_config("tiny", ["draft.kind=mtp"])
    assert build_config("tiny", ["rollout.drafter=history+mtp"]).rollout.network == "mtp"
    with pytest.raises(ValueError, match=r"shadow_drafters: history is not made of the parts"):
        build_config("tiny", ["pipeline.shadow_every=1", "pipeline.shadow_drafters=[history]"])
    with pytest.raises(ValueError, match=r"shadow_drafters: mtp is not made of the parts"):
        build_config(  # the run's network is EAGLE-3: an 'mtp' shadow would be it, mislabelled
            "tiny",
            [
                "rollout.drafter=history+eagle3",
                "pipeline.shadow_every=1",
                "pipeline.shadow_drafters=[mtp]",
            ],
        )
    with pytest.raises(ValueError, match=r"shadow_drafters needs pipeline.shadow_every > 0"):
        build_config(
            "tiny", ["rollout.drafter=history+eagle3", "pipeline.shadow_drafters=[eagle3]"]
        )
    with pytest.raises(ValueError, match=r"rollout.k must be >= 0"):
        build_config("tiny", ["rollout.k=-1"])
    with pytest.raises(ValueError, match=r"rollout.nodes is retired: set rollout.k"):
        build_config("tiny", ["rollout.nodes=16"])
    with pytest.raises(ValueError, match=r"rollout.k must be <= 64 for rollout.drafter=eagle3"):
        build_config("tiny", ["rollout.k=65"])
    cfg = build_config("tiny", ["rollout.drafter=history", "rollout.k=16"])
    assert cfg.rollout.tree and not cfg.rollout.network and cfg.rollout.k_max == 16
    assert build_config("tiny", ["rollout.drafter=history", "rollout.k=0"]).rollout.k_max == 32


def test_one_run_measures_every_drafter_on_the_same_requests(tiny_setup, tmp_path):
    """pipeline.shadow_drafters: at shadow steps the step's requests are also generated by
    the run's drafter's parts alone (same weights, seeds, history): per-drafter figures
    in one run; the rollouts trained on are the run's own."""
    overrides = (
        *HISTORY,
        "rollout.drafter=history+eagle3",
        "pipeline.shadow_every=1",
        "pipeline.shadow_drafters=[eagle3, history]",
        "pipeline.steps=2",
    )
    ms = make_trainer(tiny_setup, tmp_path / "run", *overrides).run()
    for m in ms[1:]:
        assert m["gen_rate_speedup"] > 0
        for name in ("eagle3", "history"):
            assert m[f"shadow/{name}/gen_rate_speedup"] > 0
            assert m[f"shadow/{name}/acceptance_length"] >= 1
            assert m[f"shadow/{name}/tokens_per_target_forward"] >= 1
            assert 0.0 <= m[f"shadow/{name}/reward"] <= 1.0  # its samples, scored


def test_a_shadow_drafter_drafts_from_the_history_before_the_step(tiny_setup, tmp_path):
    """A shadow history drafter starts from the store as it was before the step and
    learns from its own rollouts, as the run's drafter did: on the same requests, seeds
    and (fixed) depths it redoes the run's own rollouts exactly. Drafting from a store
    that already held the step's rollouts would copy them instead. The run's own store
    is put back: the same as a run's without shadows."""
    policy, tok = tiny_setup
    untouched = (copy.deepcopy(policy), tok)  # each run trains its own policy in place
    overrides = (*HISTORY, "pipeline.shadow_every=1", "pipeline.shadow_drafters=[history]")
    t = make_trainer(tiny_setup, tmp_path / "run", *overrides, "pipeline.steps=3")
    ms = [m for m in t.run() if "tokens_per_target_forward" in m]
    for m in ms:
        for key in ("tokens_per_target_forward", "acceptance_length", "reward"):
            assert m[f"shadow/history/{key}"] == m[key], key
    assert max(m["acceptance_length"] or 1 for m in ms) > 1  # the prompts recur: drafts
    alone = make_trainer(untouched, tmp_path / "alone", *HISTORY, "pipeline.steps=3")
    ref = [m for m in alone.run() if "tokens_per_target_forward" in m]
    assert [m["tokens_per_target_forward"] for m in ref] == [
        m["tokens_per_target_forward"] for m in ms
    ]
    store, mine = (x.rollout.engine.drafter.state_dict() for x in (t, alone))
    assert store.keys() == mine.keys()
    for k in store:
        same = torch.equal(store[k], mine[k]) if torch.is_tensor(store[k]) else store[k] == mine[k]
        assert same, k
