"""Bounds of the numbers given on the command line, checked before anything loads.

argparse converts `--seed 9223372036854775808` or `--temperature 1e-40` without
complaint; the value then fails deep inside torch after the model has loaded (an
overflow when seeding a generator, NaN log-probs), or never fails and silently means
something else (a temperature that rounds to 0 in fp32 samples at T = 1). Each check
here raises a ValueError naming the flag, the value and what is allowed, which the
command line prints as one `error:` line (exit status 2).
"""

from __future__ import annotations

import math

MAX_K = 64
"""Deepest draft a --k flag takes (as `rollout.k`: later positions are almost never
accepted, and each costs a verification column)."""
MAX_BATCH = 4096
"""Most rows a --batches flag takes (each is an engine cache slot)."""
MAX_SEED = (1 << 63) - 1
"""Largest seed a flag takes: torch seeds a generator with a 64-bit integer, and every
command derives its further seeds by adding to this one."""


def check_range(flag: str, value: float | None, low: float, high: float) -> None:
    """ValueError naming `flag` unless `value` (None: not given) is a number in
    [low, high] (NaN is not)."""
    if value is not None and not low <= value <= high:
        raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")


def check_seed(flag: str, value: int, high: int = MAX_SEED) -> None:
    """ValueError naming `flag` unless `value` is a seed in [0, high]."""
    if not 0 <= value <= high:
        raise ValueError(f"{flag} must be an integer in [0, {high}], got {value}")


def check_temperature(flag: str, value: float, greedy: bool = True) -> None:
    """ValueError naming `flag` unless `value` is 0 (greedy, when `greedy`) or a finite
    temperature >= MIN_TEMPERATURE (`rl.config.rollout`: why lower ones break)."""
    from specroll.rl.config.rollout import MIN_TEMPERATURE  # (torch: not for simulate)

    if (greedy and value == 0) or (math.isfinite(value) and value >= MIN_TEMPERATURE):
        return
    allowed = f"0 (greedy) or a number >= {MIN_TEMPERATURE}" if greedy else f">= {MIN_TEMPERATURE}"
    raise ValueError(f"{flag} must be {allowed}, got {value}")


def int_list(flag: str, text: str, low: int, high: int) -> tuple[int, ...]:
    """The comma-separated integers of `flag`, each in [low, high]; ValueError naming the
    flag, the text and the form (e.g. '--k 1,3,5') otherwise."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"{flag} takes comma-separated integers in [{low}, {high}] (e.g. {flag} "
            f"{low},{min(low + 2, high)}), got {text!r}"
        ) from None
    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise ValueError(f"{flag} values must be in [{low}, {high}], got {bad[0]} in {text!r}")
    return values
