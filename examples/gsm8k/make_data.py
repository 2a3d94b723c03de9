"""Write train.jsonl: GSM8K-style word problems with worked answers ending '#### N'.

The records are generated here (nothing is downloaded) from a fixed seed, in GSM8K's own
layout: {"question": str, "answer": "<reasoning>\\n#### <number>", "data_source": str}.
Run it from anywhere: `python examples/gsm8k/make_data.py` rewrites the same file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas"]
ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cards", "shells"]


def shopping(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    n, price, paid = r.randint(2, 9), r.randint(2, 12), 100
    cost = n * price
    q = (
        f"{name} buys {n} {item} that cost ${price} each and pays with a ${paid} bill. "
        f"How much change does {name} get?"
    )
    a = f"The {item} cost {n} * {price} = ${cost}.\nThe change is {paid} - {cost} = ${paid - cost}."
    return q, a, paid - cost


def sharing(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    friends, each, left = r.randint(2, 6), r.randint(3, 10), r.randint(1, 9)
    total = friends * each + left
    q = (
        f"{name} has {total} {item} and gives {each} to each of {friends} friends. "
        f"How many {item} does {name} have left?"
    )
    a = (
        f"{name} gives away {friends} * {each} = {friends * each} {item}.\n"
        f"{name} has {total} - {friends * each} = {left} {item} left."
    )
    return q, a, left


def saving(r: random.Random) -> tuple[str, str, int]:
    name = r.choice(NAMES)
    start, weekly, weeks = r.randint(5, 40), r.randint(2, 15), r.randint(2, 8)
    saved = weekly * weeks
    q = (
        f"{name} has ${start} and saves ${weekly} every week. "
        f"How much money does {name} have after {weeks} weeks?"
    )
    total = start + saved
    a = f"{name} saves {weekly} * {weeks} = ${saved}.\n{name} has {start} + {saved} = ${total}."
    return q, a, total


KINDS = {"shopping": shopping, "sharing": sharing, "saving": saving}


def records(n: int = 48, seed: int = 0) -> list[dict]:
    """`n` records, the kinds in turn (so any tail holds each data source)."""
    out = []
    for i in range(n):
        kind = list(KINDS)[i % len(KINDS)]
        q, reasoning, value = KINDS[kind](random.Random(f"{seed}-{i}"))
        out.append(
            {"question": q, "answer": f"{reasoning}\n#### {value}", "data_source": f"gsm8k-{kind}"}
        )
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("train.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    print(f"wrote {path}")
