"""Training drafts: data collection from the engine, TTT training, evaluation and the
default recipe. Proposers (what the engine calls) live in `specroll.drafters`."""
