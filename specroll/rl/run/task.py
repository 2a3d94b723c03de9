"""What each RL step samples: its problems, the requests (with their seeds) and rewards.

Everything here is a pure function of (pipeline.seed, step), which is what makes a
resumed run repeat the uninterrupted one exactly; every seed the run derives from
its base seed is defined in this file, once (the profile's prompts: engine.profile).
"""

from __future__ import annotations

import torch

from specroll.engine.request import Request, SamplingParams
from specroll.rl.config import MAX_REFILL_ROUNDS, TrainConfig
from specroll.tasks.arithmetic import Problem
from specroll.tasks.reward import math_reward
from specroll.tasks.sets import encode, load_file, math_problems

STEP_STRIDE = 1_000_003
"""step_seed(base, s) = base * STEP_STRIDE + s: distinct (base, step) pairs never meet."""
REQUESTS_PER_STEP = 100_000
"""Request seeds of step s start at step_seed * this (room for that many rollouts)."""
VAL_SEED_OFFSET = 10_000
"""Validation problems come from seed + this (a separate stream from training's)."""
VALIDATION_SEED = 7_777_777
"""First request seed of the validation rollouts (the same every time: comparable)."""
REFILL_SEED_OFFSET = 1 << 40
"""Refill prompts (dynamic sampling) of (step, round) come from the problem stream
REFILL_SEED_OFFSET + step_seed * (MAX_REFILL_ROUNDS + 1) + round: apart from training's
and validation's, and from every other (step, round)."""


def step_seed(base: int, step: int) -> int:
    """The seed of everything step `step` draws (torch's global RNG, request seeds)."""
    return base * STEP_STRIDE + step


def task_items(cfg: TrainConfig) -> list[Problem] | None:
    """The problems of a file task (checked: answers present, more than the validation
    set), or None for the procedural math task. Called before any model is loaded."""
    if cfg.data.task == "math":
        return None
    items = load_file(cfg.data.task)
    missing = [p.uid for p in items if not p.answer]
    if missing:
        raise ValueError(
            f"{cfg.data.task}: records without an answer ('answer' or "
            f"reward_model.ground_truth): {', '.join(missing[:5])}"
        )
    if len(items) <= cfg.data.val_size:
        raise ValueError(
            f"{cfg.data.task} holds {len(items)} problems, not more than "
            f"data.val_size={cfg.data.val_size}"
        )
    return items


class Task:
    """The task of a run, step by step."""

    def __init__(self, cfg: TrainConfig, tok) -> None:
        self.cfg, self.tok = cfg, tok
        self.file_items = task_items(cfg)

    def problems(self, step: int) -> list[Problem]:
        """The prompts of `step` (a pure function of seed and step)."""
        d, seed = self.cfg.data, self.cfg.pipeline.seed
        P = d.prompts_per_step
        if self.file_items is None:
            return math_problems((step + 1) * P, seed, d.levels)[step * P :]
        train = self.file_items[: len(self.file_items) - d.val_size]
        out = []
        for i in range(step * P, (step + 1) * P):
            epoch, j = divmod(i, len(train))
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed + epoch))
            out.append(train[int(perm[j])])
        return out

    def validation(self) -> list[Problem]:
        """The held-out problems (the file's last `val_size`, or their own math stream)."""
        d = self.cfg.data
        if self.file_items is not None:
            return self.file_items[len(self.file_items) - d.val_size :]
        return math_problems(d.val_size, self.cfg.pipeline.seed + VAL_SEED_OFFSET, d.levels)

    def step_requests(self, step: int) -> list[Request]:
        """The rollout requests of `step` (a pure function of seed and step)."""
        seed = step_seed(self.cfg.pipeline.seed, step) * REQUESTS_PER_STEP
        return self.requests(self.problems(step), self.cfg.data.group_size, seed)

    def refill_problems(self, step: int, rnd: int, used: list[Problem]) -> list[Problem]:
        """Refill round `rnd` (1, 2, ...) of `step` (dynamic sampling): prompts_per_step
        problems drawn from their own stream, a pure function of (seed, step, round), none
        whose prompt is in `used` (the step's own and its earlier rounds'); fewer when a
        task of few distinct prompts (a file, or math level 1 alone) has no more new ones
        among the candidates (4 x prompts_per_step math problems, or the whole file)."""
        d, P = self.cfg.data, self.cfg.data.prompts_per_step
        seed = (
            REFILL_SEED_OFFSET
            + step_seed(self.cfg.pipeline.seed, step) * (MAX_REFILL_ROUNDS + 1)
            + rnd
        )
        if self.file_items is None:
            # a few times more candidates than needed: small levels repeat prompts
            pool = math_problems(4 * P, seed, d.levels)
        else:
            train = self.file_items[: len(self.file_items) - d.val_size]
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
            pool = [train[int(i)] for i in perm]
        seen = {p.prompt for p in used}
        out = []
        for p in pool:
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
            ids = encode(self.tok, p)
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

    def rewards(self, problems: list[Problem], results, samples: int) -> torch.Tensor:
        """[P, samples] math-verified rewards of the results (in request order)."""
        out = []
        for i, res in enumerate(results):
            p = problems[i // samples]
            text = p.response_prefix + self.tok.decode(res.token_ids)
            out.append(math_reward(text, p.answer))
        return torch.tensor(out, device="cpu").view(len(problems), samples)
