"""The algorithm as pure functions of tensors: the GRPO/DAPO objective (`loss`), padded
batches and their micro-batches (`batch`), log-probs from the LM head (`logprobs`), the
engine-vs-learner mismatch bound (`mismatch`), and where the old log-probs of a step come
from (`old_logprobs`)."""
