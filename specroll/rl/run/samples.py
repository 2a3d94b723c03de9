"""Sample completions of each step (`log.samples: N`), for reading what the policy writes.

N of a step's rollouts are written to `out_dir/samples.jsonl` (one JSON object a line)
and given to the loggers. Which N is a pure function of the step (a generator of its
own, seeded with SAMPLES_SEED + step, never the run's RNG): the same rollouts are shown
for a step whether the run was resumed or not, and taking them changes nothing the run
computes. A line holds:

  step, index (in the step's rollouts), group (its prompt's index), uid, prompt, answer,
  completion (decoded, special tokens dropped), reward, length (tokens), finish_reason,
  policy_version, and with speculative rollouts drafted / accepted (draft tokens
  verified / accepted for this rollout: the engine's per-request counters);
  reward_components ({name: value}) when the reward comes in parts.
"""

from __future__ import annotations

import torch

from specroll.tasks.arithmetic import Problem

SAMPLES_SEED = 24_681_357
"""Seeds the choice of step s's samples (SAMPLES_SEED + s), apart from every run seed."""


def pick(step: int, total: int, n: int) -> list[int]:
    """The indices (ascending) of the `n` rollouts of `step` shown, out of `total`."""
    g = torch.Generator().manual_seed(SAMPLES_SEED + step)
    return sorted(torch.randperm(total, generator=g)[: min(n, total)].tolist())


def rows(
    step: int,
    n: int,
    problems: list[Problem],
    results: list,
    rewards: torch.Tensor,
    tok,
    components: dict[str, torch.Tensor] | None = None,
    speculative: bool = True,
) -> list[dict]:
    """The sample lines of `step` (the step count after it, as in metrics.jsonl).

    results: the step's rollouts in request order (G per problem); rewards: [P, G];
    components: reward parts by name, each [P, G] like `rewards` (None: a single reward).
    """
    if n <= 0:
        return []
    G = len(results) // len(problems)
    flat = rewards.reshape(-1)
    parts = {k: v.reshape(-1) for k, v in (components or {}).items()}
    out = []
    for i in pick(step, len(results), n):
        r, p = results[i], problems[i // G]
        row = {
            "step": step,
            "index": i,
            "group": i // G,
            "uid": p.uid,
            "prompt": p.prompt,
            "answer": p.answer,
            "completion": tok.decode(r.token_ids),
            "reward": round(float(flat[i]), 6),
            "length": len(r.token_ids),
            "finish_reason": r.finish_reason,
            "policy_version": r.policy_version,
        }
        if speculative:
            row["drafted"] = int(r.spec.draft_tokens)
            row["accepted"] = int(r.spec.accepted_tokens)
        if parts:
            row["reward_components"] = {k: round(float(v[i]), 6) for k, v in parts.items()}
        out.append(row)
    return out
