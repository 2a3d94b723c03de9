"""Drafter training data sampled from the policy itself.

A draft must imitate what the policy *samples* at the RL settings, not a dataset's text:
`collect` rolls the policy out with the engine at the RL temperature, then runs the
policy's full-sequence forward over prompt + response and keeps, per token,

* `aux`   [N, 3H] fp16  the residual-stream states EAGLE-3 fuses (aux layers, in order);
* `final` [N, H]  fp16  the last layer after the final norm (MTP's input, and the policy's
                        logits: logits = final @ lm_head);
* `lse`   [N]     fp32  logsumexp of the tempered full-vocabulary logits, so the policy's
                        log-probs over any draft vocabulary are (final @ W_vocab) / T - lse
                        without storing a [N, V] table;

with `tokens`, `offsets` and `prompt_lens`. Shards of `shard_size` rollouts are written
atomically (temp file + rename); an interrupted run resumes at the first missing shard
and, rollout seeds being a function of the rollout index, produces the same data.
`meta.json` records the policy and the settings; resuming with different ones is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, SamplingParams
from specroll.inputs import read_json, regular
from specroll.model.transformer import Transformer
from specroll.tasks.sets import encode, prompt_set

FORMAT = 1

SEED_STRIDE = 1_000_003
"""Rollout i of a data set with seed s is seeded s * SEED_STRIDE + i: sets never share."""


@dataclass
class DraftDataConfig:
    """How to sample the policy for drafter training data."""

    prompts: str = "math"
    """Prompt set: 'math', 'chat' or a file (see tasks.sets)."""
    n: int = 512
    """Rollouts to collect (one per prompt)."""
    temperature: float = 1.0
    """Sampling temperature: the RL one (the draft learns this distribution)."""
    max_new_tokens: int = 128
    """Response budget per rollout."""
    seed: int = 0
    """Prompt-set seed and base of the per-rollout sampling seeds."""
    shard_size: int = 64
    """Rollouts per shard (the unit of resumption)."""
    max_batch: int = 32
    """Engine slots used for the rollouts."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (drafts learn a distribution), got {self.temperature}"
            )
        for name in ("max_new_tokens", "shard_size", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _meta(policy: Transformer, policy_id: str, aux: tuple[int, ...], cfg: DraftDataConfig) -> dict:
    c = policy.cfg
    return {
        "format": FORMAT,
        "policy": policy_id,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "aux_layers": list(aux),
        "config": asdict(cfg),
    }


def default_aux_layers(policy: Transformer) -> tuple[int, int, int]:
    L = policy.cfg.num_layers
    return (2, L // 2, L - 3)


@torch.inference_mode()
def features(
    policy: Transformer,
    seqs: list[list[int]],
    aux: tuple[int, ...],
    temperature: float,
    chunk_tokens: int = 4096,
) -> list[dict[str, torch.Tensor]]:
    """Per sequence: aux [n, 3H] fp16, final [n, H] fp16, lse [n] fp32 (see module doc)."""
    L = policy.cfg.num_layers
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[dict[str, torch.Tensor] | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        width = len(seqs[order[i]])
        j = i + 1
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= chunk_tokens:
            j += 1
        group = order[i:j]
        width = max(len(seqs[g]) for g in group)
        toks = torch.zeros(len(group), width, dtype=torch.long)
        for r, g in enumerate(group):
            toks[r, : len(seqs[g])] = torch.tensor(seqs[g])
        o = policy(toks, hidden_layers=(*aux, L), return_logits=False)
        h = o.hidden[L]
        final = policy.final_state(h)
        lse = torch.logsumexp((final @ policy.head_weight) / temperature, dim=-1)  # [n, W]
        cat = torch.cat([o.hidden[a] for a in aux], dim=-1)  # [n, W, 3H]
        for r, g in enumerate(group):
            n = len(seqs[g])
            out[g] = {"aux": cat[r, :n].half(), "final": final[r, :n].half(), "lse": lse[r, :n]}
        i = j
    return out  # type: ignore[return-value]


@torch.no_grad()
def token_mass(
    final: torch.Tensor, head: torch.Tensor, temperature: float = 1.0, chunk: int = 2048
) -> torch.Tensor:
    """[V] the policy's probability of each id summed over positions, from their final
    states ([n, H], any float dtype) and its LM head ([H, V]); `chunk` positions' full
    distributions are held at once."""
    mass = torch.zeros(head.shape[1], device=head.device)  # [V]
    for i in range(0, final.shape[0], chunk):
        logits = final[i : i + chunk].float() @ head  # [<= chunk, V]
        mass += torch.softmax(logits / temperature, dim=-1).sum(0)
    return mass


def prompt_ids(tok, cfg: DraftDataConfig) -> list[list[int]]:
    """The `cfg.n` prompts of set `cfg.prompts`, encoded as the RL loop encodes them."""
    return [encode(tok, p) for p in prompt_set(cfg.prompts, cfg.n, cfg.seed)]


def collect(
    policy: Transformer,
    prompts: list[list[int]],
    policy_id: str,
    cfg: DraftDataConfig,
    out_dir: str | Path,
    aux: tuple[int, ...] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Sample one rollout per prompt (`cfg.n` of them, see `prompt_ids`) and store their
    features in `out_dir`; resumes at the first missing shard."""
    if len(prompts) != cfg.n:
        raise ValueError(f"got {len(prompts)} prompts for n={cfg.n}")
    out = Path(out_dir)
    aux = tuple(aux or default_aux_layers(policy))
    meta = _meta(policy, policy_id, aux, cfg)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != meta:
            diff = sorted(k for k in meta if old.get(k) != meta[k])
            raise ValueError(
                f"{out} holds data collected with other settings ({', '.join(diff)}); "
                "use the same settings to resume, or another --out"
            )
    else:
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    engine = Engine(policy, EngineConfig(max_batch=cfg.max_batch, seed=cfg.seed))
    n_shards = -(-cfg.n // cfg.shard_size)
    done = 0
    if progress is not None:
        progress(0, cfg.n)  # the total, at once (a shard takes minutes)
    for s in range(n_shards):
        lo, hi = s * cfg.shard_size, min(cfg.n, (s + 1) * cfg.shard_size)
        path = out / f"shard-{s:05d}.safetensors"
        if not path.exists():
            tick = _ticker(progress, lo, cfg.n)
            _write_shard(policy, engine, prompts[lo:hi], lo, cfg, aux, path, tick)
        done = hi
        if progress is not None:
            progress(done, cfg.n)
    return out


def _ticker(progress: Callable[[int, int], None] | None, first: int, n: int):
    """The engine's on_progress for one shard: progress(rollouts finished, n) per rollout,
    so the bar moves while a shard samples, not once it is written."""
    if progress is None:
        return None
    finished = first

    def tick(_tokens: int, newly_finished: int) -> None:
        nonlocal finished
        if newly_finished:
            finished += newly_finished
            progress(finished, n)

    return tick


def _write_shard(policy, engine, prompts, first: int, cfg, aux, path: Path, tick=None) -> None:
    reqs = [
        Request(
            ids,
            SamplingParams(
                cfg.temperature,
                max_new_tokens=cfg.max_new_tokens,
                seed=cfg.seed * SEED_STRIDE + first + i,
            ),
        )
        for i, ids in enumerate(prompts)
    ]
    results = engine.generate(reqs, on_progress=tick)
    seqs = [r.prompt_ids + r.token_ids for r in results]
    feats = features(policy, seqs, aux, cfg.temperature)
    lengths = torch.tensor([len(q) for q in seqs])
    tensors = {
        "tokens": torch.tensor([t for q in seqs for t in q], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        "aux": torch.cat([f["aux"] for f in feats]),
        "final": torch.cat([f["final"] for f in feats]),
        "lse": torch.cat([f["lse"] for f in feats]),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


@dataclass
class Sequence:
    """One stored rollout."""

    tokens: torch.Tensor  # [n] long
    prompt_len: int
    aux: torch.Tensor  # [n, 3H] fp16
    final: torch.Tensor  # [n, H] fp16
    lse: torch.Tensor  # [n] fp32


class DraftData:
    """The sequences of a data directory, in memory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"{self.path} is not a draft data directory (no meta.json)")
        self.meta = read_json(meta_path, "draft data meta.json")
        if not isinstance(self.meta, dict):
            raise ValueError(f"{meta_path}: not a JSON object")
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{self.path}: data format {self.meta.get('format')} != {FORMAT}")
        shards = sorted(self.path.glob("shard-*.safetensors"))
        if not shards:
            raise ValueError(f"{self.path} holds no shards yet (run `specroll draft data`)")
        self.sequences: list[Sequence] = []
        for sh in shards:
            t = load_file(str(regular(sh, "draft data shard")))
            off = t["offsets"].tolist()
            for i in range(len(off) - 1):
                a, b = off[i], off[i + 1]
                self.sequences.append(
                    Sequence(
                        t["tokens"][a:b].long(),
                        int(t["prompt_lens"][i]),
                        t["aux"][a:b],
                        t["final"][a:b],
                        t["lse"][a:b],
                    )
                )

    def check_policy(self, policy: Transformer) -> None:
        """Refuse data sampled from a policy of another shape or vocabulary."""
        c = policy.cfg
        for name, want in (
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("num_layers", c.num_layers),
        ):
            if self.meta[name] != want:
                raise ValueError(
                    f"data in {self.path} has {name}={self.meta[name]}, the policy has {want}"
                )

    @property
    def temperature(self) -> float:
        return float(self.meta["config"]["temperature"])

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.meta["aux_layers"])

    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)

    @torch.no_grad()
    def expected_token_mass(self, policy: Transformer, chunk: int = 2048) -> torch.Tensor:
        """[V] sum over generated positions of the policy's probability of each id.

        The expected count of every id in the responses: unlike sampled counts it also
        ranks the tail the policy could have sampled (a draft vocabulary chosen from it
        covers more of p than one chosen from the ids that happened to be drawn)."""
        rows = [s.final[max(s.prompt_len - 1, 0) : len(s.tokens) - 1] for s in self.sequences]
        final = torch.cat(rows)  # [n, H] fp16
        return token_mass(final, policy.head_weight, self.temperature, chunk)
