"""An update's prompts, each computed once: GRPO's group shares its prompt, so the
learner runs the prompt once and each row's response on top of it.

The plain forward runs every row from its first token, so a group of 8 computes its
prompt 8 times; in the default run (prompts of 38-40 tokens, responses of 15-40) that is
about half of the learner's tokens. Here a prompt pass runs every distinct prompt of the
update once, with autograd, and leaves each layer's keys and values and the residual
states the head and the draft read; each micro-batch then runs only its rows' responses,
attending over their prompt's keys (a `KeyChain` seeded with them) and their own.

Gradients: the prompt pass's outputs enter the micro-batches as leaves (detached,
requiring grad), so each micro-batch's backward stops at them and adds into their
`.grad`; one backward through the prompt pass at the end of the update (`backward`)
carries the sum into the weights. That is the gradient of the plain forward (the same
function of the weights; float rounding apart): the chain rule summed over the rows that
read each prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specroll.model.kv_cache import KeyChain
from specroll.model.ops import additive_mask, attention_layout, fold_mask
from specroll.model.transformer import Transformer
from specroll.rl.algo.batch import Batch, MicroBatch

ENABLED = True
"""Share prompts where an update repeats them (tests compare against the plain forward)."""


class PromptPass:
    """The distinct prompts of an update, computed once; micro-batches run on top of it."""

    def __init__(
        self,
        model: Transformer,
        prompts: list[tuple[int, ...]],
        prompt_of: list[int],
        prompt_lens: list[int],
        layers: Sequence[int],
    ) -> None:
        self.model = model
        self.prompt_of = prompt_of
        """[N] the batch row's prompt, an index into `prompts`."""
        self.prompt_lens = prompt_lens
        dev = model.embed.device
        P = max(len(p) for p in prompts)
        tokens = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], device=dev)
        keys, values, hidden = _run(model, tokens, None, None, P, layers)
        grad = torch.is_grad_enabled()
        self._outs = [*keys, *values, *hidden.values()]
        self._leaves = leaves = [t.detach().requires_grad_(grad) for t in self._outs]
        n = len(keys)
        self.keys, self.values = leaves[:n], leaves[n : 2 * n]  # per layer [U, Hkv, P, hd]
        self.hidden = dict(zip(hidden, leaves[2 * n :], strict=True))  # {i: [U, P, H]}

    @classmethod
    def of(
        cls, model: Transformer, batch: Batch, layers: Sequence[int], limit: int
    ) -> PromptPass | None:
        """The prompt pass of `batch` (its rows' distinct prompts), or None when no
        prompt repeats (nothing to share) or when it would run more than `limit` padded
        tokens (its activations are kept for the whole update: at most a micro-batch's)."""
        if not ENABLED:
            return None
        tokens = batch.tokens.cpu().tolist()  # (one read of the batch)
        lens = batch.prompt_lens.tolist()
        index: dict[tuple[int, ...], int] = {}
        prompt_of = [
            index.setdefault(tuple(t[:p]), len(index)) for t, p in zip(tokens, lens, strict=True)
        ]
        if len(index) == len(tokens) or len(index) * max(lens) > limit:
            return None
        return cls(model, list(index), prompt_of, lens, layers)

    def hidden_states(self, b: Batch, m: MicroBatch, layers: Sequence[int]) -> dict:
        """The states `model(b.tokens, hidden_layers=layers)` returns for micro-batch `m`
        ({i: [n, W, H]}), from its responses run on top of their prompts."""
        dev = b.tokens.device
        rows = torch.tensor([self.prompt_of[i] for i in m.idx], device=dev)
        starts_host = [self.prompt_lens[i] for i in m.idx]
        R = max(n - p for n, p in zip(m.lengths, starts_host, strict=True))
        starts = torch.tensor(starts_host, device=dev)  # [n]
        W = b.tokens.shape[1]
        at = (starts.unsqueeze(1) + torch.arange(R, device=dev)).clamp(max=W - 1)  # [n, R]
        prefix = ([k[rows] for k in self.keys], [v[rows] for v in self.values])
        top = max(starts_host) + R  # (from the host: no read of the device)
        _, _, resp = _run(self.model, b.tokens.gather(1, at), starts, prefix, top, layers)
        P = self.keys[0].shape[2]
        t = torch.arange(W, device=dev).unsqueeze(0)  # [1, W]
        s = starts.unsqueeze(1)
        src = torch.where(t < s, t, P + t - s).clamp(max=P + R - 1)  # [n, W] into [prompt, resp]
        out = {}
        for i, h in resp.items():
            both = torch.cat([self.hidden[i][rows], h], dim=1)  # [n, P + R, H]
            out[i] = both.gather(1, src.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return out

    def backward(self) -> None:
        """Carry the gradients the micro-batches left on the leaves through the prompt
        pass (once per update, after every micro-batch's backward)."""
        pairs = [
            (o, leaf.grad)
            for o, leaf in zip(self._outs, self._leaves, strict=True)
            if leaf.grad is not None and o.requires_grad
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._outs = self._leaves = []  # (their graph is spent)


def _run(
    model: Transformer,
    tokens: torch.Tensor,
    starts: torch.Tensor | None,
    prefix: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
    top: int,
    layers: Sequence[int],
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, torch.Tensor]]:
    """The decoder over `tokens` [B, T]: prompts from position 0 (no prefix), or responses
    at positions starts[b].. attending over their prompt's keys and values `prefix`
    (per layer [B, Hkv, P, hd]; key j < starts[b] visible) and their own, causally.
    `top` bounds the positions (RoPE tables). Returns each layer's keys and values
    ([B, Hkv, T, hd]) and the states in `layers`."""
    cfg = model.cfg
    B, T = tokens.shape
    if prefix is None:
        pos, mask, _, _ = attention_layout(cfg, tokens, None, None)
    else:
        dev = tokens.device
        P = prefix[0][0].shape[2]
        pos = starts.unsqueeze(1) + torch.arange(T, device=dev)  # [B, T]
        seen = torch.arange(P, device=dev).view(1, 1, P) < starts.view(B, 1, 1)  # [B, 1, P]
        own = torch.ones(T, T, dtype=torch.bool, device=dev).tril()  # [T, T]
        both = torch.cat([seen.expand(B, T, P), own.expand(B, T, T)], dim=-1)  # [B, T, P+T]
        mask = fold_mask(both, cfg.num_heads // cfg.num_kv_heads)
    rope = model.rotary(pos, top)
    x = model.embed_tokens(tokens)
    mask = additive_mask(mask, x.dtype)
    hidden = {0: x} if 0 in layers else {}
    keys, values = [], []
    for i, layer in enumerate(model.layers):
        chain = KeyChain()
        if prefix is not None:
            chain.k, chain.v = prefix[0][i], prefix[1][i]
        x = layer(x, pos, mask, rope, chain, 0, None)
        keys.append(chain.k[:, :, -T:] if prefix is not None else chain.k)
        values.append(chain.v[:, :, -T:] if prefix is not None else chain.v)
        if i + 1 in layers:
            hidden[i + 1] = x
    return keys, values, hidden
