"""What each RL step samples: its problems, the requests (with their seeds) and rewards.

Problems come from the procedural math task or from data files (`data.train`, `data.val`);
rewards from `reward.functions` (`tasks.rewards`: built-ins here, user functions in their
own process).

Everything here is a pure function of (pipeline.seed, step), which is what makes a
resumed run repeat the uninterrupted one exactly; every seed the run derives from
its base seed is defined in this file, once (the profile's prompts: engine.profile).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specroll.engine.request import Request, SamplingParams
from specroll.rl.config import MAX_REFILL_ROUNDS, REQUESTS_PER_STEP, STEP_STRIDE, TrainConfig
from specroll.tasks.arithmetic import Problem
from specroll.tasks.records import Joined, missing_answers
from specroll.tasks.rewards import RewardSet, Sample
from specroll.tasks.sets import Keys, encode, load_file, math_problems

VAL_SEED_OFFSET = 10_000
"""Validation problems come from seed + this (a separate stream from training's)."""
VALIDATION_SEED = 7_777_777
"""First request seed of the validation rollouts (the same every time: comparable)."""
MATH_POOL_SCAN = 16
"""The math pool is looked for among at most this many times (pool + validation) problems
of the stream (level 1 alone repeats itself: a pool larger than it holds fails)."""
REFILL_SEED_OFFSET = 1 << 40
"""Refill prompts (dynamic sampling) of (step, round) come from the problem stream
REFILL_SEED_OFFSET + step_seed * (MAX_REFILL_ROUNDS + 1) + round: apart from training's
and validation's, and from every other (step, round)."""


def step_seed(base: int, step: int) -> int:
    """The seed of everything step `step` draws (torch's global RNG, request seeds)."""
    return base * STEP_STRIDE + step


@dataclass
class TaskFiles:
    """The problems of a run's data files (None: not given)."""

    train: Sequence[Problem] | None
    """`data.train`; None = the procedural math task."""
    val: Sequence[Problem] | None
    """`data.val`, its first `data.val_size` records; None = held out of train."""

    def all(self) -> Joined | None:
        """Every problem of the files (what `rl.budget` bounds), or None without files."""
        if self.train is None and self.val is None:
            return None
        return Joined([self.train or [], self.val or []])

    def training(self, val_size: int) -> Sequence[Problem] | None:
        """The problems a run trains on: the training file's, less the last `val_size`
        when they are held out for validation (no data.val); None = the math task."""
        if self.train is None or self.val is not None:
            return self.train
        return self.train[: len(self.train) - val_size]


_LOADED: dict[str, TaskFiles] = {}
"""The data files this process read last, by `_files_key`: planning, the draft's start
and the task all ask for them, and a million records are read once, not four times."""


def _files_key(cfg: TrainConfig) -> str:
    """The data settings and the files' sizes and times (a file changed since is read
    again)."""
    d = cfg.data
    stamps = []
    for path in (d.train, d.val):
        try:
            st = os.stat(path) if path else None
            stamps.append(st and (st.st_size, st.st_mtime_ns))
        except OSError:
            stamps.append(None)
    return repr((d, cfg.reward.needs_answers, stamps))


def task_files(
    cfg: TrainConfig, progress: Callable[[str, int, int], None] | None = None
) -> TaskFiles:
    """The run's data files, loaded and checked (answers present where a built-in reward
    needs them; more training records than a held-out validation set takes), read once
    per process. Called before any model is loaded; `progress(setting, lines read,
    lines)` hears how far each file is read."""
    key = _files_key(cfg)
    if key not in _LOADED:
        files = _read_files(cfg, progress)
        _LOADED.clear()
        _LOADED[key] = files
    return _LOADED[key]


def _read_files(cfg: TrainConfig, progress) -> TaskFiles:
    d = cfg.data
    keys = Keys(d.prompt_key, d.answer_key)

    def read(name: str, path: str) -> list[Problem]:
        tick = None if progress is None else (lambda done, total: progress(name, done, total))
        return load_file(path, keys, d.response_prefix, tick)

    train = read("data.train", d.train) if d.train else None
    val = read("data.val", d.val)[: d.val_size] if d.val else None
    for name, items in (("data.train", train), ("data.val", val)):
        missing = missing_answers(items or []) if cfg.reward.needs_answers else []
        if missing:
            raise ValueError(
                f"{name}: records without an answer (field {d.answer_key!r}"
                + (", or reward_model.ground_truth" if d.answer_key == "answer" else "")
                + f"), which reward.functions {list(cfg.reward.functions)} compare with: "
                f"{', '.join(missing[:5])}"
            )
    if train is not None and val is None and len(train) <= d.val_size:
        raise ValueError(
            f"{d.train} holds {len(train)} problems, not more than "
            f"data.val_size={d.val_size} (held out for validation; or give data.val)"
        )
    files = TaskFiles(train, val)
    training = files.training(d.val_size)
    if training is not None and d.pool > len(training):
        held = f" (less the data.val_size={d.val_size} held out)" if val is None else ""
        raise ValueError(
            f"data.pool={d.pool} is more than the {len(training)} training records of "
            f"{d.train}{held}: at most {len(training)}, or 0 for all of them"
        )
    return files


def math_pool(n: int, seed: int, levels: tuple[int, ...], exclude: set[str]) -> list[Problem]:
    """The math task's training pool: the first `n` distinct prompts of its stream (`seed`)
    that are not in `exclude` (the validation prompts: the small levels repeat themselves,
    so the two streams share a few)."""
    size = n
    while True:
        out, seen = [], set(exclude)
        for p in math_problems(size, seed, levels):
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        if len(out) >= n:
            return out[:n]
        if size >= MATH_POOL_SCAN * (n + len(exclude)):
            raise ValueError(
                f"data.pool={n}: the math task at data.levels={list(levels)} has only "
                f"{len(out)} distinct prompts apart from validation's among its first "
                f"{size}; give a smaller pool or more levels"
            )
        size *= 2


def task_items(cfg: TrainConfig, progress=None) -> Joined | None:
    """Every problem of the run's data files (what `rl.budget` bounds), or None when it
    has none (`progress`: as `task_files`)."""
    return task_files(cfg, progress).all()


@dataclass
class StepRewards:
    """The rewards of a step's results."""

    total: torch.Tensor
    """[P, samples]: what the advantages are computed from."""
    parts: dict[str, torch.Tensor]
    """Per reward function (and dict component): [P, samples] values, unweighted."""

    def metrics(self) -> dict[str, float]:
        """{'reward/<function>': mean, 'reward/<function>/<component>': mean}."""
        return {f"reward/{k}": round(float(v.mean()), 4) for k, v in self.parts.items()}


def prompt_ids(cfg: TrainConfig, tok, problem: Problem) -> list[int]:
    """A problem's prompt ids as the run's requests hold them (data.system_prompt and
    data.chat_template_kwargs applied): what the default draft samples, too."""
    d = cfg.data
    return encode(tok, problem, d.system_prompt, d.chat_template_kwargs)


class Task:
    """The task of a run, step by step."""

    def __init__(self, cfg: TrainConfig, tok) -> None:
        self.cfg, self.tok = cfg, tok
        self.files = task_files(cfg)
        self.file_items = self.files.all()
        """Every problem of the data files (None: none), for `rl.budget`."""
        self.pool = self._pool()
        """The training problems cycled in epochs (None: the endless math stream)."""
        r = cfg.reward
        self.reward = RewardSet(r.functions, r.weights, r.timeout_s)
        self.reward.start()
        self.stop: Callable[[], None] | None = None
        """Called while `score` waits on the reward worker (the trainer's stop check):
        what it raises ends the reward stage at once."""

    def _pool(self) -> list[Problem] | None:
        """The first `data.pool` training problems (all of a file's when 0; None: the math
        task without a pool, which never repeats)."""
        d = self.cfg.data
        train = self.files.training(d.val_size)
        if train is not None:
            return train[: d.pool] if d.pool else train
        if not d.pool:
            return None
        held_out = {p.prompt for p in self.validation()}
        return math_pool(d.pool, self.cfg.pipeline.seed, d.levels, held_out)

    def problems(self, step: int) -> list[Problem]:
        """The prompts of `step` (a pure function of seed and step): positions step * P ..
        (step + 1) * P of the math stream, or of the pool's epochs, each a permutation of
        the pool seeded pipeline.seed + epoch."""
        d, seed = self.cfg.data, self.cfg.pipeline.seed
        P, pool = d.prompts_per_step, self.pool
        if pool is None:
            return math_problems((step + 1) * P, seed, d.levels)[step * P :]
        perms: dict[int, torch.Tensor] = {}
        out = []
        for i in range(step * P, (step + 1) * P):
            epoch, j = divmod(i, len(pool))
            if epoch not in perms:
                gen = torch.Generator().manual_seed(seed + epoch)
                perms[epoch] = torch.randperm(len(pool), generator=gen)
            out.append(pool[int(perms[epoch][j])])
        return out

    def epoch(self, step: int) -> float | None:
        """Epochs of the pool done before `step` starts (fractional: 1.5 = halfway through
        the second); None for the math stream without a pool (it has no epochs)."""
        if self.pool is None:
            return None
        return step * self.cfg.data.prompts_per_step / len(self.pool)

    def validation(self) -> list[Problem]:
        """The validation problems: data.val's, the training file's last `val_size`, or
        the math task's own stream."""
        d = self.cfg.data
        if self.files.val is not None:
            return self.files.val
        if self.files.train is not None:
            return self.files.train[len(self.files.train) - d.val_size :]
        return math_problems(d.val_size, self.cfg.pipeline.seed + VAL_SEED_OFFSET, d.levels)

    def step_requests(self, step: int) -> list[Request]:
        """The rollout requests of `step` (a pure function of seed and step)."""
        seed = step_seed(self.cfg.pipeline.seed, step) * REQUESTS_PER_STEP
        return self.requests(self.problems(step), self.cfg.data.group_size, seed)

    def refill_problems(self, step: int, rnd: int, used: list[Problem]) -> list[Problem]:
        """Refill round `rnd` (1, 2, ...) of `step` (dynamic sampling): prompts_per_step
        problems drawn from their own stream, a pure function of (seed, step, round), none
        whose prompt is in `used` (the step's own and its earlier rounds'); fewer when a
        task of few distinct prompts (a file, a pool, or math level 1 alone) has no more
        new ones among the candidates (4 x prompts_per_step math problems, or the whole
        pool: data.pool's, or the training file's, in an order of the round's own)."""
        d, P = self.cfg.data, self.cfg.data.prompts_per_step
        seed = (
            REFILL_SEED_OFFSET
            + step_seed(self.cfg.pipeline.seed, step) * (MAX_REFILL_ROUNDS + 1)
            + rnd
        )
        if self.pool is None:
            # a few times more candidates than needed: small levels repeat prompts
            candidates = math_problems(4 * P, seed, d.levels)
        else:
            gen = torch.Generator().manual_seed(seed)
            order = torch.randperm(len(self.pool), generator=gen).tolist()
            candidates = (self.pool[i] for i in order)  # built as far as they are read
        seen = {p.prompt for p in used}
        out = []
        for p in candidates:
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
                if len(out) == P:
                    break
        return out

    def refill_requests(self, step: int, rnd: int, problems: list[Problem]) -> list[Request]:
        """The rollout requests of refill round `rnd` of `step`: seeds after the step's own
        and earlier rounds' (round r starts r * prompts_per_step * group_size further)."""
        d = self.cfg.data
        seed = step_seed(self.cfg.pipeline.seed, step) * REQUESTS_PER_STEP
        return self.requests(problems, d.group_size, seed + rnd * d.prompts_per_step * d.group_size)

    def requests(self, problems: list[Problem], samples: int, base_seed: int) -> list[Request]:
        """`samples` requests per problem, seeded base_seed, base_seed + 1, ..."""
        r = self.cfg.rollout
        reqs = []
        for i, p in enumerate(problems):
            ids = self.encode(p)
            for g in range(samples):
                params = SamplingParams(
                    r.temperature,
                    top_k=r.top_k,
                    top_p=r.top_p,
                    max_new_tokens=r.max_new_tokens,
                    seed=base_seed + i * samples + g,
                )
                reqs.append(Request(ids, params))
        return reqs

    def encode(self, problem: Problem) -> list[int]:
        """A problem's prompt ids (data.system_prompt and data.chat_template_kwargs applied)."""
        return prompt_ids(self.cfg, self.tok, problem)

    def samples(self, problems: list[Problem], results, samples: int) -> list[Sample]:
        """What the reward functions score: each result with its problem's record."""
        out = []
        for i, res in enumerate(results):
            p = problems[i // samples]
            record = dict(p.record) if p.record else {"prompt": p.prompt, "level": p.level}
            record["answer"] = p.answer
            text = p.response_prefix + self.tok.decode(res.token_ids)
            out.append(Sample(p.prompt, text, record, p.uid))
        return out

    def score(self, problems: list[Problem], results, samples: int) -> StepRewards:
        """[P, samples] rewards of the results (in request order), with each function's
        values; a reward function that fails raises `RewardError` (nothing is updated).
        The step's reward stage: a stop request (`stop`) ends it at once."""
        scores = self.reward.score(self.samples(problems, results, samples), self.stop)
        shape = (len(problems), samples)
        parts = {k: torch.tensor(v, device="cpu").view(shape) for k, v in scores.parts.items()}
        return StepRewards(torch.tensor(scores.total, device="cpu").view(shape), parts)

    def rewards(self, problems: list[Problem], results, samples: int) -> torch.Tensor:
        """[P, samples] rewards of the results (in request order), never cut short by a
        stop request: validation and the shadow runs score after the step's update, whose
        metrics must be logged before the run stops."""
        stop, self.stop = self.stop, None
        try:
            return self.score(problems, results, samples).total
        finally:
            self.stop = stop

    def zero_reward_hint(self, problems: list[Problem], results, samples: int) -> str:
        """The likely cause when every reward of a step is 0, with an example."""
        return self.reward.zero_hint(self.samples(problems, results, samples))

    def close(self) -> None:
        """Stop the reward worker process, if any."""
        self.reward.close()
