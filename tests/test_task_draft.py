"""The default draft of a run on a data file is built on that file's training prompts.

The in-domain draft (drafting.default) is what makes speculation pay; built on the math
set for a run on someone's own data, it would be out of domain (paper §1.4). These tests
stop the build at its sampling stage and look at what it was about to sample.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest


class _Sampled(Exception):
    """Raised by the stand-in for `collect`: the build stops before sampling anything."""

    def __init__(self, prompts, out_dir) -> None:
        self.prompts, self.out_dir = prompts, out_dir


def _sampled(setup, monkeypatch, *overrides: str) -> _Sampled:
    """What `build_draft` (draft.init=offline) would sample, and where it would cache it."""
    from specroll.drafting import default
    from specroll.model.hub import resolve
    from specroll.rl.config import build_config
    from specroll.rl.run.draft import build_draft

    def collect(policy, prompts, policy_id, cfg, out_dir, **kw):
        raise _Sampled(prompts, out_dir)

    monkeypatch.setattr(default, "collect", collect)
    policy, tok = setup
    cfg = build_config("tiny", ["draft.init=offline", *overrides])
    with pytest.raises(_Sampled) as e:
        build_draft(cfg, policy, tok, resolve("tiny"))
    return e.value


def _task_file(path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(path)


@pytest.mark.parametrize("held_out", [True, False], ids=["val-held-out", "data.val"])
def test_the_default_draft_of_a_data_file_samples_its_training_prompts(
    tiny_setup, tmp_path, monkeypatch, held_out
):
    """Every training prompt and no validation one, encoded as the run's requests are
    (here with a system prompt), shuffled and cycled to the recipe's size."""
    from specroll.drafting.default import DefaultDraftRecipe
    from specroll.rl.config import build_config
    from specroll.rl.run.task import prompt_ids
    from specroll.tasks.sets import load_file

    _, tok = tiny_setup
    f = _task_file(tmp_path / "task.jsonl", [f"question {i}?" for i in range(12)])
    val = _task_file(tmp_path / "val.jsonl", ["held out?"])
    sets = [f"data.train={f}", "data.system_prompt=Be brief.", "data.val_size=4"]
    sets += [] if held_out else [f"data.val={val}"]
    got = _sampled(tiny_setup, monkeypatch, *sets)
    cfg = build_config("tiny", sets)
    items = load_file(f)[: 8 if held_out else 12]
    train = [prompt_ids(cfg, tok, p) for p in items]
    assert "Be brief." in tok.decode(train[0])  # the run's encoding, system prompt included
    assert len(got.prompts) == DefaultDraftRecipe().data.n  # cycled to the recipe's size
    assert {tuple(p) for p in got.prompts} == {tuple(p) for p in train}
    assert got.prompts[: len(train)] != train  # a mix, not file order


def test_drafts_of_different_data_are_cached_apart_and_the_math_key_is_unchanged(
    tiny_setup, tmp_path, monkeypatch
):
    """A draft built on one data set is never loaded for another; the math task's cached
    drafts (23 minutes each on a CPU) keep their key."""
    from specroll.drafting.data import prompt_ids
    from specroll.drafting.default import DefaultDraftRecipe, _key
    from specroll.model.hub import resolve

    _, tok = tiny_setup
    a = _task_file(tmp_path / "a.jsonl", [f"add {i}" for i in range(10)])
    b = _task_file(tmp_path / "b.jsonl", [f"sub {i}" for i in range(10)])
    dirs = [
        _sampled(tiny_setup, monkeypatch, f"data.train={f}", "data.val_size=2").out_dir
        for f in (a, b)
    ]
    math = _sampled(tiny_setup, monkeypatch)
    assert len({str(d) for d in [*dirs, math.out_dir]}) == 3
    recipe = DefaultDraftRecipe()
    recipe = replace(recipe, train=replace(recipe.train, kind="eagle3"))
    key = _key(resolve("tiny"), recipe)  # what a math draft was cached under before
    assert math.out_dir.parent.name.endswith(f"-eagle3-{key}")
    assert math.prompts == prompt_ids(tok, recipe.data)
