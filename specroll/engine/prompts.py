"""A small built-in prompt set for `specroll generate` and the engine benchmark."""

BUILTIN_PROMPTS = [
    "What is 7 times 8? Answer briefly.",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "A farmer has 12 sheep and buys 5 more. How many sheep does he have?",
    "What is the capital of France, and what is it famous for?",
    "Describe how to make a cup of tea.",
    "List four prime numbers greater than 10.",
]
