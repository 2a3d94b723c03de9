"""A generic instruction set built procedurally: varied everyday requests.

It is the out-of-domain control for drafter training (paper §1.4: a draft initialised on
generic chat accepts less than one initialised on the policy's own task outputs), so it
deliberately avoids arithmetic. Like the math tasks it is a pure function of (seed, index).
"""

from __future__ import annotations

import random

_TOPICS = [
    "the ocean",
    "a rainy afternoon",
    "city gardens",
    "old trains",
    "coffee",
    "winter hiking",
    "a small bakery",
    "learning the piano",
    "public libraries",
    "bicycles",
    "the night sky",
    "a family dinner",
    "moving to a new town",
    "houseplants",
    "a street market",
    "friendship",
    "autumn leaves",
    "a lighthouse",
    "morning routines",
    "board games",
    "a lost umbrella",
    "mountain lakes",
    "recycling",
    "a museum visit",
    "homemade soup",
    "remote work",
]
_AUDIENCES = ["a child", "a busy parent", "a new student", "a retired teacher", "a tourist"]
_TEMPLATES = [
    "Write a short poem about {topic}.",
    "Describe {topic} in three sentences.",
    "Give me three tips related to {topic}.",
    "Write a friendly message inviting a neighbour to talk about {topic}.",
    "Explain to {audience} why people enjoy {topic}.",
    "Tell a very short story that involves {topic}.",
    "List some words that come to mind when thinking about {topic}.",
    "Write a product description for something inspired by {topic}.",
    "What are the pros and cons of {topic}? Keep it brief.",
    "Summarise what {audience} should know about {topic}.",
    "Suggest a weekend plan built around {topic}.",
    "Write a haiku about {topic}.",
]


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` everyday requests, reproducible from `seed`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out = []
    for i in range(n):
        r = random.Random(f"chat-{seed}-{i}")
        t = r.choice(_TEMPLATES)
        out.append(t.format(topic=r.choice(_TOPICS), audience=r.choice(_AUDIENCES)))
    return out
