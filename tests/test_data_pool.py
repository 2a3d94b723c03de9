"""data.pool: the training prompts cycled in epochs, as RL over a dataset revisits it. A
step's prompts are positions step * P .. (step + 1) * P of a sequence of epochs, each a
permutation of the pool seeded pipeline.seed + epoch: a pure function of (seed, step),
apart from validation, and with pool = 0 exactly the stream it always was."""

from __future__ import annotations

import json

import pytest
import torch

from specroll.rl.config import build_config
from specroll.rl.run import task as task_module
from specroll.rl.run.task import Task
from specroll.tasks.sets import math_problems

P = 4  # the tiny preset's prompts_per_step (val_size 8)


def _task(*sets: str) -> Task:
    """A Task of the tiny preset (no tokenizer: nothing here encodes a prompt)."""
    return Task(build_config("tiny", list(sets)), None)


def _jsonl(path, n: int) -> str:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(n)))
    return str(path)


def _uids(task: Task, steps: range) -> list[list[str]]:
    return [[p.uid for p in task.problems(s)] for s in steps]


def test_prompts_recur_once_per_epoch_in_a_new_order():
    task = _task("data.pool=16")
    steps = _uids(task, range(12))  # three epochs of 16 / 4 = 4 steps
    pool = {p.uid for p in task.pool}
    assert len(task.pool) == 16 and len({p.prompt for p in task.pool}) == 16
    epochs = [sum(steps[4 * e : 4 * e + 4], []) for e in range(3)]
    for order in epochs:  # every prompt of the pool exactly once per epoch
        assert sorted(order) == sorted(pool)
    assert len({tuple(order) for order in epochs}) == 3  # each epoch in its own order
    assert task.epoch(0) == 0.0 and task.epoch(4) == 1.0 and task.epoch(6) == 1.5
    # the pool is the first 16 distinct prompts of the math stream
    stream = math_problems(64, task.cfg.pipeline.seed, task.cfg.data.levels)
    firsts = []
    for p in stream:
        if p.prompt not in {q.prompt for q in firsts} and p.prompt not in _val(task):
            firsts.append(p)
    assert [p.uid for p in task.pool] == [p.uid for p in firsts[:16]]


def _val(task: Task) -> set[str]:
    return {p.prompt for p in task.validation()}


def test_a_pool_is_a_pure_function_of_seed_and_step():
    a, b = _task("data.pool=12"), _task("data.pool=12")
    assert _uids(a, range(10)) == _uids(b, range(10))
    assert _uids(a, [7, 2]) == _uids(b, range(10))[7:8] + _uids(b, range(10))[2:3]  # any order
    other = _task("data.pool=12", "pipeline.seed=1")
    assert _uids(other, range(3)) != _uids(a, range(3))


@pytest.mark.parametrize("levels", ["[1]", "[1, 2]"])
def test_the_math_pool_never_meets_validation(levels):
    # level 1 alone repeats itself: the training and validation streams share prompts,
    # which the pool leaves out
    task = _task("data.pool=64", "data.val_size=64", f"data.levels={levels}")
    assert len(task.pool) == 64
    assert not {p.prompt for p in task.pool} & _val(task)
    seen = {p.prompt for s in range(20) for p in task.problems(s)}
    assert len(seen) == 64 and not seen & _val(task)


def test_a_level_too_small_for_the_pool_is_named(monkeypatch):
    monkeypatch.setattr(task_module, "MATH_POOL_SCAN", 1)  # a short scan: a fast test
    with pytest.raises(ValueError, match=r"data.pool=7000: the math task at data.levels=\[1\]"):
        _task("data.pool=7000", "data.levels=[1]", "data.val_size=0")


def test_pool_zero_is_the_endless_math_stream_unchanged():
    task = _task()
    assert task.pool is None and task.epoch(5) is None
    seed, levels = task.cfg.pipeline.seed, task.cfg.data.levels
    for s in (0, 1, 7):
        want = math_problems((s + 1) * P, seed, levels)[s * P :]
        assert task.problems(s) == want
    # pinned: what runs made before data.pool drew
    assert [p.uid for p in task.problems(1)] == ["1-0-2", "2-0-2", "1-0-3", "2-0-3"]


def test_a_file_pool_cycles_its_first_records_and_never_validation(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", 30)  # the last 8 held out for validation
    task = _task(f"data.train={f}", "data.pool=8")
    assert [p.prompt for p in task.pool] == [f"q{i}" for i in range(8)]
    val = _val(task)
    assert val == {f"q{i}" for i in range(22, 30)}
    for e in range(3):
        epoch = [p.prompt for s in (2 * e, 2 * e + 1) for p in task.problems(s)]
        assert sorted(epoch) == sorted(f"q{i}" for i in range(8))
        assert not set(epoch) & val
    assert task.epoch(3) == 1.5
    # refill candidates come from the pool, none of the step's own
    own = task.problems(0)
    extra = task.refill_problems(0, 1, own)
    assert len(extra) == 4 and {p.prompt for p in extra} <= {p.prompt for p in task.pool}
    assert not {p.prompt for p in extra} & {p.prompt for p in own}
    assert extra == task.refill_problems(0, 1, own)
    assert task.refill_problems(0, 1, [*own, *extra]) == []  # the pool is spent


def test_a_file_without_a_pool_draws_as_before(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", 30)
    task = _task(f"data.train={f}")
    train = task.files.train[:22]
    assert task.pool == train and task.epoch(11) == 2.0
    for s in (0, 5, 6):
        want = []
        for i in range(s * P, (s + 1) * P):
            epoch, j = divmod(i, len(train))
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))
            want.append(train[int(perm[j])])
        assert task.problems(s) == want


def test_a_pool_larger_than_the_file_or_smaller_than_a_step_is_refused(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", 30)
    with pytest.raises(ValueError, match=r"data.pool=23 is more than the 22 training records"):
        _task(f"data.train={f}", "data.pool=23")
    val = _jsonl(tmp_path / "v.jsonl", 8)
    with pytest.raises(ValueError, match=r"data.pool=31 is more than the 30 training records"):
        _task(f"data.train={f}", f"data.val={val}", "data.pool=31")
    assert len(_task(f"data.train={f}", f"data.val={val}", "data.pool=30").pool) == 30
    for bad in ("-1", "3"):
        with pytest.raises(ValueError, match=r"data.pool must be 0 .* or at least data.prompts"):
            build_config("tiny", [f"data.pool={bad}"])


def test_the_default_preset_cycles_64_prompts():
    assert build_config("default").data.pool == 64
