"""Draft networks a run starts from without sampling anything: `draft.init: random | policy`.

An in-domain draft built offline (`drafting.default`) costs minutes of sampling and
training before the first RL step; the rollouts RL generates are that same in-domain
data, and the draft trains on them online from step 1 (`rl.learner`). So a run can start
at once from a draft that costs a second to make:

* **random**: the draft layer (and EAGLE-3's `fc`) drawn at random, the read-out (norm,
  LM head) the policy's;
* **policy**: everything the policy's own weights can give: the decoder layer is the
  policy's last layer, EAGLE-3's `fc` passes the deepest fused feature through
  unchanged, and the norms are the policy's (an MTP head's layer likewise).

Either way an EAGLE-3 draft's vocabulary is the `size` ids the policy expects most at
the positions of the task's prompts (its probabilities summed over them: one forward
over the prompts, in-domain, no sampling), where an offline draft counts them over
sampled responses. Which start the default takes is measured (README, issue 47).
"""

from __future__ import annotations

import torch

from specroll.drafting.data import default_aux_layers, token_mass
from specroll.drafting.eagle3_head import Eagle3Head
from specroll.drafting.mtp_heads import MTPDraft
from specroll.drafting.train import new_eagle3, new_mtp, select_vocab
from specroll.model.transformer import Transformer

STARTS = ("random", "policy")
"""The draft starts that need no sampling."""
PROMPT_TOKENS = 1024
"""Most prompt tokens the vocabulary's forward reads (padded): 25 of the default task's 64
math prompts. With the head's products over them that is 2.1 s on a 2-core Zen 4 (4096,
all 64 prompts: 6.1 s), and the 25 prompts repeat the 64's template and questions' shapes."""


@torch.inference_mode()
def prompt_vocab(policy: Transformer, prompts: list[list[int]], size: int) -> torch.Tensor:
    """[size] the ids with the largest expected count at the prompts' positions (the
    policy's next-token probabilities summed over them), ascending; ties: smaller id."""
    V = policy.cfg.vocab_size
    if size >= V:
        return torch.arange(V)
    if not prompts:
        raise ValueError("prompt_vocab: no prompts")
    dev = next(policy.parameters()).device
    width = max(len(p) for p in prompts)
    rows = max(1, min(len(prompts), PROMPT_TOKENS // max(width, 1)))
    tokens = torch.zeros(rows, width, dtype=torch.long)  # [n, W]
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r, p in enumerate(prompts[:rows]):
        tokens[r, : len(p)] = torch.tensor(p)
        mask[r, : len(p)] = True
    L = policy.cfg.num_layers
    h = policy(tokens.to(dev), hidden_layers=(L,), return_logits=False).hidden[L]
    final = policy.final_state(h)[mask.to(dev)]  # [tokens, H]
    return select_vocab(token_mass(final, policy.head_weight).cpu(), size)


def fresh_draft(
    start: str,
    kind: str,
    policy: Transformer,
    prompts: list[list[int]],
    seed: int,
    vocab_size: int,
) -> Eagle3Head | MTPDraft:
    """A draft network of `kind` ('eagle3' | 'mtp') started as `start` says (module
    docstring); `prompts` (token ids) choose an EAGLE-3 draft's `vocab_size` ids."""
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    if kind == "mtp":
        return new_mtp(policy, seed, from_last_layer=start == "policy")
    size = min(vocab_size, policy.cfg.vocab_size)
    head = new_eagle3(policy, prompt_vocab(policy, prompts, size), default_aux_layers(policy), seed)
    return from_policy(head, policy) if start == "policy" else head


def from_policy(head: Eagle3Head, policy: Transformer) -> Eagle3Head:
    """`head` with the policy's weights wherever they fit: `fc` the identity on the
    deepest fused state (the stream after L-3 layers, which the policy's last layers
    read out), the decoder layer the policy's last one — its attention reading both
    halves of EAGLE-3's [token embedding, fused state] input through the same
    projections — and the final norm the policy's."""
    last = policy.layers[-1]
    H = policy.cfg.hidden_size
    if tuple(last.wqkv.shape) != (H, head.wqkv.shape[1]) or last.w_down.shape != head.w_down.shape:
        raise ValueError("draft.init=policy: the draft layer is not shaped like the policy's")
    with torch.no_grad():
        head.fc.zero_()
        head.fc[2 * H :].copy_(torch.eye(H))  # [3H, H]: the third (deepest) state
        head.wqkv.copy_(torch.cat([last.wqkv, last.wqkv]))  # [2H, q + 2kv]
        for mine, theirs in (
            (head.wo, last.wo),
            (head.w_gate_up, last.w_gate_up),
            (head.w_down, last.w_down),
            (head.input_layernorm, last.attn_norm),
            (head.hidden_norm, last.attn_norm),
            (head.post_attention_layernorm, last.mlp_norm),
            (head.norm, policy.norm),
        ):
            mine.copy_(theirs)
    return head
