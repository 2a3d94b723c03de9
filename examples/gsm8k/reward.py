"""A reward function for GSM8K-style records, in the one signature specroll calls:

    fn(prompt: str, completion: str, record: dict) -> float | dict[str, float]

`record` is the data record (here question, answer, data_source). A dict return is a set of
named components: each is logged (reward/gsm8k_reward/correct, .../marked) and their sum
is this function's reward. It runs in a separate process, so it may import what it likes.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The number after the last '####', else the last number in the text."""
    tail = text.rpartition("####")[2] if "####" in text else text
    found = NUMBER.findall(tail)
    return float(found[-1].replace(",", "")) if found else None


def gsm8k_reward(prompt: str, completion: str, record: dict) -> dict[str, float]:
    """1 for the right final number, plus 0.1 for marking it GSM8K's way ('#### N')."""
    said, gold = final_number(completion), final_number(record["answer"])
    return {
        "correct": float(said is not None and said == gold),
        "marked": 0.1 if "####" in completion else 0.0,
    }
