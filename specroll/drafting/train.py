"""Offline drafter training on policy samples: EAGLE-3 heads and MTP heads, with TTT.

`train_draft` reads a `DraftData` directory, builds (or resumes) a draft, and trains it
with the training-time-test unroll of `drafting.ttt`. The policy is only read: its
embedding (and, for MTP, LM head and final norm) are detached views, and its logits come
from the stored `final` states. Everything random (initialisation, batch order) derives
from `seed`, and the trainer state (optimizer, schedule, position in the epoch) is saved
with every checkpoint, so an interrupted run resumes to the same weights it would have
reached.

EAGLE-3 specifics: the draft vocabulary is the `draft_vocab_size` ids with the largest
expected count in the responses (the policy's probability summed over generated
positions; d2t / t2d map it to the target's), and the draft
LM head starts as the policy's LM head restricted to it, so training begins from the
policy's own read-out rather than from noise.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specroll.drafting.data import DraftData, Sequence
from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head
from specroll.drafting.eagle3_io import load_eagle3
from specroll.drafting.mtp_heads import MTPConfig, MTPDraft
from specroll.drafting.mtp_io import load_mtp, load_native_mtp
from specroll.drafting.trainable import NETWORKS, TrainableDraft, save_draft
from specroll.drafting.ttt import draft_loss
from specroll.model.transformer import Transformer
from specroll.model.untrusted import UnreadableFile, load_tensors


@dataclass
class DraftTrainConfig:
    """Offline drafter training settings."""

    kind: str = "eagle3"
    """Draft architecture: 'eagle3' or 'mtp' (one fresh head, recursive)."""
    draft_vocab_size: int = 8192
    """EAGLE-3 draft vocabulary (most frequent generated ids); ignored for MTP."""
    ttt_steps: int = 7
    """Training-time-test unroll length."""
    step_decay: float = 0.8
    """Loss weight of unroll step j is step_decay**j."""
    epochs: int = 2
    """Passes over the training sequences."""
    batch_tokens: int = 4096
    """Most (padded) tokens per batch."""
    lr: float = 1e-3
    """Peak AdamW learning rate (cosine decay after a linear warm-up)."""
    warmup_frac: float = 0.05
    """Share of the steps spent warming up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Gradient-norm clip."""
    eval_frac: float = 0.05
    """Share of the sequences (the last ones) held out for evaluation."""
    seed: int = 0
    """Seeds initialisation and batch order."""
    checkpoint_every: int = 200
    """Optimizer steps between checkpoints (0 = only at the end)."""
    init: str = ""
    """Fine-tune an existing draft instead of a fresh one: an EAGLE-3 directory (specroll,
    SpecForge or vLLM layout), specroll MTP heads, or a model with native MTP weights."""

    def __post_init__(self) -> None:
        if self.kind not in NETWORKS:
            raise ValueError(f"kind must be one of {NETWORKS}, got {self.kind!r}")
        for name in ("draft_vocab_size", "ttt_steps", "epochs", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("warmup_frac", "eval_frac"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")


def select_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` ids with the largest counts (ties: smaller id first), sorted ascending."""
    if size > counts.numel():
        raise ValueError(f"draft_vocab_size={size} exceeds the vocabulary ({counts.numel()})")
    order = torch.sort(counts.double(), descending=True, stable=True).indices[:size]
    return order.sort().values


def new_eagle3(
    policy: Transformer, vocab: torch.Tensor, aux: tuple[int, ...], seed: int
) -> Eagle3Head:
    """Fresh head on `policy` over draft vocabulary `vocab` (ascending target ids)."""
    cfg = Eagle3Config.for_target(policy.cfg, draft_vocab_size=vocab.numel())
    cfg = Eagle3Config.from_layer(cfg.layer, vocab.numel(), aux)
    head = Eagle3Head(cfg, policy).init_weights(seed)
    with torch.no_grad():
        head.lm_head.copy_(policy.head_weight[:, vocab])
        head.d2t.copy_(vocab - torch.arange(vocab.numel()))
        head.t2d.zero_()
        head.t2d[vocab] = True
    return head


def new_mtp(policy: Transformer, seed: int, from_last_layer: bool = True) -> MTPDraft:
    """One fresh MTP head on `policy`, its decoder layer started as the policy's last
    (`from_last_layer`) or at random."""
    net = MTPDraft(MTPConfig.for_target(policy.cfg, 1), policy)
    return net.init_weights(seed, from_last_layer=from_last_layer)


def head_weight(policy: Transformer, vocab: torch.Tensor | None) -> torch.Tensor:
    """[H, V'] the policy's LM head over a draft vocabulary, detached (offline targets:
    online training reads the live policy's logits instead of a copy of its head)."""
    w = policy.head_weight.detach()
    return w if vocab is None else w[:, vocab].contiguous()


def _batches(seqs: list[Sequence], budget: int, g: torch.Generator) -> list[list[int]]:
    """Batches of similar-length sequences (little padding) within `budget` padded tokens,
    in a random order; ties in length are broken randomly."""
    perm = torch.randperm(len(seqs), generator=g).tolist()
    ranked = sorted(perm, key=lambda i: len(seqs[i].tokens))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in ranked:  # ascending: the newest sequence is the widest
        if cur and len(seqs[i].tokens) * (len(cur) + 1) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    order = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in order]


def _collate(seqs: list[Sequence]) -> dict[str, torch.Tensor]:
    n, W = len(seqs), max(len(s.tokens) for s in seqs)
    H3, H = seqs[0].aux.shape[1], seqs[0].final.shape[1]
    b = {
        "tokens": torch.zeros(n, W, dtype=torch.long),
        "aux": torch.zeros(n, W, H3),
        "final": torch.zeros(n, W, H),
        "lse": torch.zeros(n, W),
        "lengths": torch.tensor([len(s.tokens) for s in seqs]),
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs]),
    }
    for r, s in enumerate(seqs):
        m = len(s.tokens)
        b["tokens"][r, :m] = s.tokens
        b["aux"][r, :m] = s.aux.float()
        b["final"][r, :m] = s.final.float()
        b["lse"][r, :m] = s.lse
    return b


def batch_loss(
    net: TrainableDraft,
    w: torch.Tensor,
    b: dict[str, torch.Tensor],
    cfg: DraftTrainConfig,
    temperature: float,
):
    """Offline TTT loss of one collated batch: targets from the stored final states and
    `w` [H, V'], the policy's LM head over the draft vocabulary (`head_weight`)."""

    def target(mask: torch.Tensor) -> torch.Tensor:
        return (b["final"][mask] @ w) / temperature - b["lse"][mask].unsqueeze(-1)

    return draft_loss(
        net,
        b["tokens"],
        aux=b["aux"],
        final=b["final"],
        lengths=b["lengths"],
        prompt_lens=b["prompt_lens"],
        target_logp=target,
        steps=cfg.ttt_steps,
        decay=cfg.step_decay,
    )


@torch.no_grad()
def evaluate(
    net: TrainableDraft,
    w: torch.Tensor,
    seqs: list[Sequence],
    cfg: DraftTrainConfig,
    temperature: float,
) -> dict:
    """Per-step top-1 agreement and expected acceptance on held-out sequences (token-weighted)."""
    sums: dict[str, list[float]] = {"top1": [0.0] * cfg.ttt_steps, "accept": [0.0] * cfg.ttt_steps}
    counts = [0] * cfg.ttt_steps
    for idx in _batches(seqs, cfg.batch_tokens, torch.Generator().manual_seed(0)):
        _, m = batch_loss(net, w, _collate([seqs[i] for i in idx]), cfg, temperature)
        for j, n in enumerate(m["count"]):
            if n:
                counts[j] += n
                for key in sums:
                    sums[key][j] += m[key][j] * n
    return {
        k: [round(v[j] / max(counts[j], 1), 4) for j in range(cfg.ttt_steps)]
        for k, v in sums.items()
    }


def _lr_at(step: int, total: int, cfg: DraftTrainConfig) -> float:
    warm = max(1, int(cfg.warmup_frac * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def train_draft(
    policy: Transformer,
    data: DraftData,
    cfg: DraftTrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    log: Callable[[dict], None] | None = None,
) -> Path:
    """Train a draft on `data` and save it (with the trainer state) in `out_dir`."""
    data.check_policy(policy)
    out = Path(out_dir)
    state_path = out / "trainer.pt"
    seqs = data.sequences
    n_eval = int(len(seqs) * cfg.eval_frac)
    train, held = seqs[: len(seqs) - n_eval], seqs[len(seqs) - n_eval :]
    if not train:
        raise ValueError(f"{data.path} holds {len(seqs)} sequences: too few to train on")
    aux = data.aux_layers
    state = None
    if resume and state_path.exists():
        state = _trainer_state(state_path)
        if state["config"] != asdict(cfg):
            raise ValueError(
                f"{state_path} was written with other settings; resume with the same ones"
            )
    torch.manual_seed(cfg.seed)
    net = _initial_draft(policy, data, cfg, aux, state)
    if state is not None:
        net.load_state_dict(state["net"])
    net.for_training()
    net.train()
    w = head_weight(policy, net.vocab)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = len(_batches(train, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed)))
    total = per_epoch * cfg.epochs
    step = 0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    for epoch in range(step // per_epoch, cfg.epochs):
        batches = _batches(
            train, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed + 1000 * epoch)
        )
        for bi in range(step - epoch * per_epoch, per_epoch):
            lr = _lr_at(step, total, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            loss, m = batch_loss(
                net, w, _collate([train[i] for i in batches[bi]]), cfg, data.temperature
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            opt.step()
            step += 1
            if log is not None:
                log(
                    {
                        "step": step,
                        "total": total,
                        "epoch": epoch,
                        "lr": lr,
                        "loss": loss.item(),
                        "grad_norm": gnorm,
                        **m,
                    }
                )
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < total:
                _checkpoint(net, opt, step, cfg, out)
    _checkpoint(net, opt, step, cfg, out)
    summary = {"steps": step, "train_sequences": len(train), "held_out_sequences": len(held)}
    if held:
        summary["held_out"] = evaluate(net, w, held, cfg, data.temperature)
    summary["data"] = str(data.path)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    net.eval()
    return out


TRAINER_STATE = {"step": int, "net": dict, "optimizer": dict, "config": dict}
"""What `trainer.pt` holds (and `vocab`: the EAGLE-3 draft vocabulary, or None)."""


def _trainer_state(path: Path) -> dict:
    """`trainer.pt`, read as data only (`load_tensors`: a file from elsewhere that asks
    to run code is refused, naming it) and checked to hold what `_checkpoint` writes."""
    state = load_tensors(path, "draft trainer state")
    if not isinstance(state, dict):
        raise UnreadableFile(f"{path}: not a draft trainer state (a {type(state).__name__})")
    for key, kind in TRAINER_STATE.items():
        if not isinstance(state.get(key), kind):
            raise UnreadableFile(f"{path}: not a draft trainer state ({key} missing)")
    return state


def _initial_draft(
    policy: Transformer, data: DraftData, cfg: DraftTrainConfig, aux, state
) -> TrainableDraft:
    """The network to start from: fresh, or cfg.init to fine-tune."""
    if cfg.kind == "eagle3":
        if cfg.init:
            net = load_eagle3(cfg.init, policy.cfg, embed=policy)
            if tuple(net.cfg.aux_layers) != tuple(aux):
                raise ValueError(
                    f"{cfg.init} reads aux layers {net.cfg.aux_layers}, the data holds {aux}"
                )
            return net
        if state is not None:
            vocab = state["vocab"]
        else:
            vocab = select_vocab(data.expected_token_mass(policy), cfg.draft_vocab_size)
        return new_eagle3(policy, vocab, aux, cfg.seed)
    if cfg.init:
        p = Path(cfg.init)
        if (p / "mtp.safetensors").is_file():
            net = load_mtp(p, policy)
        else:
            net = load_native_mtp(p, policy)
        if net.num_heads != 1:
            raise ValueError(f"{cfg.init} has {net.num_heads} MTP heads; training supports one")
        return net
    return new_mtp(policy, cfg.seed)


def _checkpoint(net: TrainableDraft, opt, step: int, cfg: DraftTrainConfig, out: Path) -> None:
    """Trainer state (the resume point, written atomically) + the draft in its serving
    layout."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "trainer.pt.tmp"
    torch.save(
        {
            "step": step,
            "net": net.state_dict(),
            "vocab": net.vocab,
            "optimizer": opt.state_dict(),
            "config": asdict(cfg),
        },
        tmp,
    )
    os.replace(tmp, out / "trainer.pt")
    save_draft(net, out)
