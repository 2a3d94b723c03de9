"""The reward of a run: `reward.functions`, weighted, on each (prompt, completion, record).

Every function has one signature,

    fn(prompt: str, completion: str, record: dict) -> float | dict[str, float]

with `completion` the reply as the reward reads it (the response prefix, if any, then the
generated text) and `record` the data record's fields, `answer` holding the ground truth.
A dict is a set of named components: they are logged separately and summed into the
function's value. The reward of a sample is the weighted sum of the functions' values.
A function must be a pure function of its arguments: a resumed run scores the same
completions again and must get the same rewards.

Every function, built-in (`tasks.reward.BUILTINS`) or the user's, runs in one worker
process (`reward_worker`) under `reward.timeout_s` per call: a function that raises, hangs
past it, returns NaN, a value beyond MAX_REWARD (`reward_refs`) or the wrong type fails
the step with a `RewardError` naming the function and the record, with the user's
traceback, before anything is updated; a stop request (the trainer's `stop` callback)
ends the stage within `reward_worker.POLL_S`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from specroll.tasks import reward_refs
from specroll.tasks.reward import NEEDS_ANSWER, extract_answer, gold_answer
from specroll.tasks.reward_worker import CallError, RewardWorker


class RewardError(ValueError):
    """A reward function failed: which one, on which record, and the user's traceback."""


@dataclass(frozen=True)
class Sample:
    """One completion to score."""

    prompt: str
    completion: str
    record: dict
    where: str
    """The record's place ('train.jsonl:12', or the procedural problem's id)."""


@dataclass
class Scores:
    """Rewards of a list of samples."""

    total: list[float]
    """Per sample: the weighted sum of the functions' values."""
    parts: dict[str, list[float]] = field(default_factory=dict)
    """Per function (its metric name) and per dict component ('name/key'): the values."""


class RewardSet:
    """`reward.functions` with their weights, ready to score samples."""

    def __init__(
        self, functions: tuple[str, ...], weights: tuple[float, ...] = (), timeout_s: float = 30.0
    ) -> None:
        self.refs = reward_refs.check(functions)
        self.names = reward_refs.names(self.refs)
        self.weights = [float(w) for w in weights] or [1.0] * len(self.refs)
        self.user = [r for r in self.refs if not r.builtin]
        self.worker = RewardWorker(self.refs, timeout_s)

    def start(self) -> None:
        """Start the worker; with user functions, wait until it has imported them (an
        import error fails here, not after the first step's generation). Built-ins alone
        load while the first step generates."""
        try:
            self.worker.start(wait=bool(self.user))
        except CallError as e:
            raise RewardError(f"reward.functions: {e.summary}{_indented(e.details)}") from None

    def close(self) -> None:
        self.worker.close()

    def score(self, samples: list[Sample], stop: Callable[[], None] | None = None) -> Scores:
        """Every function on every sample; RewardError at the first that fails. `stop` is
        called while the worker computes: what it raises ends the stage at once."""
        n = len(samples)
        calls = [(j, i) for j in range(len(self.refs)) for i in range(n)]
        try:
            got = self.worker.call(
                [(s.prompt, s.completion, s.record) for s in samples], calls, stop
            )
        except CallError as e:
            if e.index < 0:  # (re)loading the functions
                raise RewardError(f"reward.functions: {e.summary}{_indented(e.details)}") from None
            j, i = calls[e.index]
            raise RewardError(self._failed(self.refs[j], samples[i], e)) from None
        values = {name: got[j * n : (j + 1) * n] for j, name in enumerate(self.names)}
        return self._combine(values, n)

    def _combine(self, values: dict[str, list], n: int) -> Scores:
        total = [0.0] * n
        parts: dict[str, list[float]] = {}
        for ref, name, w in zip(self.refs, self.names, self.weights, strict=True):
            vals = values[name]
            flat = [sum(v.values()) if isinstance(v, dict) else v for v in vals]
            parts[name] = flat
            keys = sorted({k for v in vals if isinstance(v, dict) for k in v})
            if len(keys) > reward_refs.MAX_COMPONENTS:
                raise RewardError(
                    f"{_what(ref)} returned {len(keys)} different component names over the "
                    f"step's {n} samples, more than {reward_refs.MAX_COMPONENTS} (each is a "
                    f"metric), e.g. {', '.join(map(repr, keys[:5]))}: use fixed names"
                )
            for k in keys:
                parts[f"{name}/{k}"] = [v.get(k, 0.0) if isinstance(v, dict) else 0.0 for v in vals]
            total = [t + w * x for t, x in zip(total, flat, strict=True)]
        return Scores(total, parts)

    def _failed(self, ref: reward_refs.Ref, s: Sample, e: CallError) -> str:
        """'reward function X (ref) raised ... on record R (prompt ..., answer ...)' and
        the user's traceback, indented."""
        what = _what(ref)
        record = f"record {s.where} (prompt {_short(s.prompt)!r}"
        if s.record.get("answer") not in (None, ""):
            record += f", answer {_short(str(s.record['answer']))!r}"
        return f"{what} {e.summary} on {record}){_indented(e.details)}"

    def zero_hint(self, samples: list[Sample]) -> str:
        """Why every reward of a step may be 0, with an example (logged once, on the first
        step, instead of training silently on no signal)."""
        head = f"every reward of the first step is 0 ({len(samples)} samples): "
        s = samples[0]
        if not any(r.builtin and r.target in NEEDS_ANSWER for r in self.refs):
            return head + (
                f"reward.functions ({', '.join(r.text for r in self.refs)}) gave 0 to all of "
                f"them, e.g. to the completion {_short(s.completion)!r} of record {s.where}"
            )
        golds = [gold_answer(str(x.record.get("answer") or "")) for x in samples]
        read = [extract_answer(x.completion) for x in samples]
        if "math" in [r.target for r in self.refs] and not any(
            re.search(r"[\d\\]", g) for g in golds
        ):
            return head + (
                f"the records' answers hold no number or LaTeX for math-verify to compare, "
                f"e.g. {golds[0]!r} ({s.where}): point data.answer_key at the field with the "
                f"final answer (a GSM8K solution ending '#### 72' is read as '72')"
            )
        if all(r is None for r in read):
            return head + (
                f"no completion commits to a final answer the extractor can read "
                f"(\\boxed{{...}}, a line 'Answer: ...' or '#### ...'), e.g. "
                f"{_short(s.completion)!r} ({s.where}, answer {golds[0]!r}): ask for one of "
                f"these in the prompts or data.system_prompt, or add a reward function "
                f"(reward.functions) that reads your format"
            )
        i = next(j for j, r in enumerate(read) if r is not None)
        return head + (
            f"the answers read from the completions never match the records', e.g. the "
            f"extractor read {read[i]!r} from {_short(samples[i].completion)!r} where "
            f"{samples[i].where}'s answer is {golds[i]!r}"
        )


def _what(ref: reward_refs.Ref) -> str:
    """'reward function NAME (REF)' (a built-in: its name alone)."""
    return f"reward function {ref.name!r}" + ("" if ref.builtin else f" ({ref.text})")


def _short(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _indented(details: str) -> str:
    if not details.strip():
        return ""
    return "\n" + "\n".join("  " + line for line in details.rstrip().splitlines())
