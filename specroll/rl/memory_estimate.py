"""An estimate of a run's peak memory, term by term, against what the machine has.

A train run's memory grows with a handful of settings: the draft depth `rollout.k` and the
response budget `rollout.max_new_tokens` (engine slot buffers and KV-cache length), the
rollout batch (`data.prompts_per_step` x `data.group_size` requests, `rollout.max_batch`
cache slots), the learner's `policy.micro_batch` (activations) and the model itself. The
estimate of the run's peak memory is checked against what the machine has, so a run that
cannot fit stops at once with one line naming the settings that size its biggest terms.

What the estimate counts (bytes; see `estimate`): the rollout side's copy of the policy
and draft weights, its KV caches (policy and draft, two engines when
`pipeline.shadow_every` > 0), the engine's slot buffers, one iteration's verification
logits and one prefill forward; the learner's fp32 weights, gradients and AdamW state
(policy, draft, and the reference policy when `loss.kl_coef` > 0), the activations one
micro-batch keeps for the backward (decoder layers and the response positions' head
log-softmax, the draft's over its `ttt_steps`) and the step's samples on the host; plus a
fixed allowance for the runtime itself. It is an upper estimate, not a measurement:
tests/test_budget.py checks that the tiny and default presets fit well inside 24 GiB.
Rollouts on Ray workers or vLLM size their own memory where they run and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from specroll.engine.iteration import PREFILL_TOKENS
from specroll.model import lora
from specroll.model.config import ModelConfig
from specroll.rl.config import TrainConfig

GiB = 1 << 30
RUNTIME_BYTES = GiB // 2
"""Python, torch, the tokenizer and allocator slack: a fixed allowance."""


@dataclass(frozen=True)
class Part:
    """One term of the memory estimate."""

    name: str
    """What it is ('KV cache')."""
    settings: str
    """The settings that size it, with their values."""
    device: str
    """Where it lives ('cpu', 'cuda:0')."""
    bytes: int
    """Its estimated size."""


def _layer_params(m: ModelConfig) -> int:
    """Parameters of one decoder layer."""
    H = m.hidden_size
    return H * (2 * m.q_size + 2 * m.kv_size) + 3 * H * m.intermediate_size + 2 * H


def _draft_params(cfg: TrainConfig, m: ModelConfig) -> int:
    """A draft's parameters: one decoder layer with a 2H-wide input, the 3H -> H fusion of
    the target's features and its own head (EAGLE-3; an MTP head is smaller)."""
    H = m.hidden_size
    return _layer_params(m) + H * (m.q_size + 2 * m.kv_size) + 3 * H * H + H * _draft_vocab(cfg, m)


def _adapted(cfg: TrainConfig, m: ModelConfig) -> tuple[int, int]:
    """(adapter parameters, parameters of the matrices they adapt) of a LoRA run; (0, 0)
    without adapters (or before lora.init's rank is read)."""
    if cfg.lora.rank <= 0:
        return 0, 0
    targets = lora.expand_targets(cfg.lora.targets)
    shapes = [lora.shape(m, t) for t in targets]
    adapters = sum(cfg.lora.rank * (i + o) for i, o in shapes) * m.num_layers
    return adapters, sum(i * o for i, o in shapes) * m.num_layers


def _draft_vocab(cfg: TrainConfig, m: ModelConfig) -> int:
    return min(cfg.draft.draft_vocab_size, m.vocab_size)


def _rollout_parts(cfg: TrainConfig, m: ModelConfig, prompt: int, dev: str) -> list[Part]:
    """The rollout engine's weights, caches and buffers (`engine.engine`, `engine.slots`)."""
    r, d = cfg.rollout, cfg.data
    wb = 2 if r.dtype == "bfloat16" else 4
    requests = max(d.prompts_per_step * d.group_size, d.val_size)
    slots = min(r.max_batch, requests)
    k = r.k_max if r.speculative else 0
    length = min(m.max_position_embeddings, prompt + r.max_new_tokens + k)
    length = min(-(-length // 64) * 64, m.max_position_embeddings)
    engines = 2 if cfg.pipeline.shadow_every else 1
    draft = _draft_params(cfg, m) if r.speculative and r.network else 0
    kv = 2 * slots * m.num_kv_heads * m.head_dim * length * wb * (m.num_layers + (k > 0))
    slot_bufs = slots * ((r.max_new_tokens + k + 1) * 12 + (length + k + 2) * 8 + k * 16)
    logits = slots * (k + 1) * m.vocab_size * 4 * 4 + slots * k * _draft_vocab(cfg, m) * 8
    rows = min(PREFILL_TOKENS, slots * prompt)  # one prefill forward
    prefill = rows * (6 * m.hidden_size + 3 * m.intermediate_size) * wb
    prefill += max(1, rows // prompt) * m.num_heads * prompt * prompt * 4
    batch = f"rollout.max_batch={r.max_batch} (slots {slots})"
    gen = f"rollout.max_new_tokens={r.max_new_tokens}, rollout.{'nodes' if r.tree else 'k'}={k}"
    weights = f"policy.model, rollout.dtype={r.dtype}"
    cache = f"{batch} x {length} positions ({gen}) x {engines} engine(s)"
    adapters, adapted = _adapted(cfg, m)
    if adapters and cfg.lora.serve == "merged":  # the fp32 base of the merged matrices
        adapters = adapters + adapted * 4 // wb
    return [
        Part("rollout weights", weights, dev, (m.num_params() + adapters + draft) * wb),
        Part("KV cache", cache, dev, kv * engines),
        Part("engine buffers", f"{batch}, {gen}", dev, slot_bufs * engines + logits + prefill),
    ]


def _learner_parts(cfg: TrainConfig, m: ModelConfig, prompt: int, dev: str) -> list[Part]:
    """The learner's state and the activations of one micro-batch (`rl.learner`)."""
    r, d, p = cfg.rollout, cfg.data, cfg.policy
    H, inter, V = m.hidden_size, m.intermediate_size, m.vocab_size
    ab = 2 if cfg.learner.dtype == "bfloat16" else 4
    rows = d.prompts_per_step * d.group_size
    micro = min(p.micro_batch, rows)
    T, resp = prompt + r.max_new_tokens, r.max_new_tokens
    draft = _draft_params(cfg, m) if r.speculative or cfg.draft.online else 0
    adapters, _ = _adapted(cfg, m)
    if cfg.lora.on:  # a frozen base: weights only; the adapters train
        state = 4 * m.num_params() + 16 * (adapters + draft)
        copied_reference = cfg.loss.kl_coef and cfg.lora.init  # else: the base, no copy
    else:
        state = 16 * (m.num_params() + draft)
        copied_reference = cfg.loss.kl_coef
    state += 4 * m.num_params() if copied_reference else 0
    per_token_layer = (10 * H + 4 * inter) * ab + m.num_heads * T * 4
    acts = micro * T * per_token_layer * m.num_layers + micro * resp * V * 4 * 2
    if cfg.draft.online:
        dv = _draft_vocab(cfg, m)
        acts += cfg.draft.ttt_steps * micro * T * (per_token_layer + 4 * H * ab + dv * 8)
    acts *= cfg.learner.ranks if cfg.learner.strategy == "fsdp" else 1
    samples = rows * (T * 32 + resp * 64)  # batch tensors, results' Python lists
    mb = f"policy.micro_batch={p.micro_batch} (rows {micro}) x {T} tokens"
    step = f"data.prompts_per_step x data.group_size = {rows}"
    return [
        Part("learner state", "policy.model, lora.* (fp32 weights, gradients, AdamW)", dev, state),
        Part("learner activations", mb, dev, acts),
        Part("step samples", step, "cpu", samples),
    ]


def estimate(
    cfg: TrainConfig, model: ModelConfig, prompt: int, devices: tuple[str, str] = ("cpu", "cpu")
) -> list[Part]:
    """The run's estimated peak memory in this process and its local learner ranks, term
    by term (module docstring: what it counts), each on its device (devices: the
    rollout's and the learner's). Rollouts on Ray workers or vLLM and learners in Ray
    actors are left out: they size their own where they run."""
    parts = [Part("runtime", "Python, torch, tokenizer", "cpu", RUNTIME_BYTES)]
    if cfg.rollout.backend == "local":
        parts += _rollout_parts(cfg, model, prompt, devices[0])
    if cfg.learner_placement() == "local":
        parts += _learner_parts(cfg, model, prompt, devices[1])
    return parts


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def check_memory(
    parts: list[Part], available: int | dict[str, int], what: str = "available"
) -> None:
    """ValueError when the estimate exceeds the memory given: one number for all of it,
    or bytes per device name ({'cpu': .., 'cuda:0': ..}); `what` names that memory."""
    problem = memory_shortfall(parts, available, what)
    if problem:
        raise ValueError(f"{problem}; lower the settings named")


def memory_shortfall(
    parts: list[Part], available: int | dict[str, int], what: str = "available"
) -> str | None:
    """The first pool the estimate does not fit, as a message naming its biggest parts."""
    pools = {"all": available} if isinstance(available, int) else available
    for pool, free in pools.items():
        mine = [p for p in parts if pool in ("all", p.device)]
        total = sum(p.bytes for p in mine)
        if total <= free:
            continue
        big = sorted(mine, key=lambda p: -p.bytes)[:3]
        terms = "; ".join(f"{p.name} {_gib(p.bytes)}: {p.settings}" for p in big)
        where = "" if pool == "all" else f" on {pool}"
        return (
            f"this run needs an estimated {_gib(total)}{where} ({terms}), more than the "
            f"{_gib(free)} {what}"
        )
    return None


def peak_estimate(cfg: TrainConfig, model: ModelConfig, prompt: int) -> int:
    """The total of `estimate` in bytes (reports, tests)."""
    return sum(p.bytes for p in estimate(cfg, model, prompt))
