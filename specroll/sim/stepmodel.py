"""Analytic step times for a model on catalogue hardware (roofline + fixed costs).

One decode/verify forward of a TP x EP group over N = B*q tokens at mean context c:

    t = step_overhead + max(t_mem, t_flop) + t_comm
    t_mem  = (weights read + KV read) / (HBM bandwidth * mem_eff)
    t_flop = (2 * active params * N + attention FLOPs) / (peak * flop_eff)
    t_comm = 2 all-reduces per layer of N * hidden bf16 values over NVLink (TP > 1),
             plus 2 all-to-alls per MoE layer of each GPU's tokens x top-k (EP > 1),
             each with a fixed latency

Weights read (per GPU): dense layers once per forward, sharded over TP; for MoE only the
experts the N tokens touch (expected distinct experts of top-k-of-E routing,
E * (1 - (1 - k/E)^N)), spread over the TP x EP GPUs. The KV read is B * c tokens' K
and V, shared by the q positions of a row — which is why verifying k+1 tokens at long
context costs much less than k+1 forwards (MagicDec).

The EAGLE-3 drafter is one decoder layer (2h attention input) + fc (3h → h) + a draft LM
head; each draft token is a small forward of B tokens. `AnalyticStep` has the same
`target / draft / overhead / iteration` interface as the fitted `CostModel`, so the
engine's `AdaptiveDepth` and the simulator accept either.
"""

from __future__ import annotations

from dataclasses import dataclass

from specroll.sim.catalogue import HardwareSpec, ModelSpec

BYTES = 2  # bf16 activations, KV and (by default) weights


@dataclass
class AnalyticStep:
    """Per-iteration times of one generation replica (a TP x EP group)."""

    model: ModelSpec
    hw: HardwareSpec
    tp: int = 1
    ep: int = 1
    draft_vocab: int = 32000
    """EAGLE-3 draft LM-head rows."""
    weight_bytes: float = BYTES
    """Bytes per generation weight; 1 = FP8 (twice the bf16 FLOP/s as well)."""

    @property
    def flops(self) -> float:
        """Peak FLOP/s of one GPU at the weights' precision."""
        return self.hw.flops * BYTES / self.weight_bytes

    @property
    def gpus(self) -> int:
        return self.tp * self.ep

    def weights_read(self, n_tokens: float) -> float:
        m = self.model
        dense = m.layers * m.attn_params + 2 * m.vocab * m.hidden
        if not m.experts:
            return self.weight_bytes * (dense + m.layers * m.expert_params) / self.gpus
        touched = m.experts * (1 - (1 - m.top_k / m.experts) ** max(n_tokens, 1.0))
        # attention / embeddings sharded over TP (replicated across EP groups), experts
        # spread over all the replica's GPUs: the bytes one GPU reads
        experts = m.layers * touched * m.expert_params / self.gpus
        return self.weight_bytes * (dense / self.tp + experts)

    def target(self, B: float, q: float, ctx: float) -> float:
        m, hw = self.model, self.hw
        n = B * q
        kv = B * ctx * m.kv_bytes_per_token / self.gpus  # rows spread over the replica
        t_mem = (self.weights_read(n) + kv) / (hw.mem_bw * hw.mem_eff)
        attn_flops = 4 * n * ctx * m.q_heads * m.head_dim * m.layers
        t_flop = (2 * m.params_active * n + attn_flops) / (self.gpus * self.flops * hw.flop_eff)
        t_comm = 0.0
        if self.tp > 1:
            per_ar = n * m.hidden * BYTES * 2 * (self.tp - 1) / self.tp / hw.link_bw
            t_comm += 2 * m.layers * (per_ar + 5e-6)
        if self.ep > 1 and m.experts:  # dispatch + combine all-to-all per MoE layer
            per_a2a = (n / self.gpus) * m.top_k * m.hidden * BYTES / hw.link_bw
            t_comm += 2 * m.layers * (per_a2a + 10e-6)
        return hw.step_overhead + max(t_mem, t_flop) + t_comm

    draft_size: float = 0.0
    """Drafter parameters per draft token's forward; 0 = one EAGLE-3 / MTP layer of this
    model (below). A separate draft model: its parameter count."""

    @property
    def draft_params(self) -> float:
        if self.draft_size:
            return self.draft_size
        h, m = self.model.hidden, self.model
        attn = 2 * h * (m.q_heads + 2 * m.kv_heads) * m.head_dim + m.q_heads * m.head_dim * h
        return 3 * h * h + attn + 3 * h * (m.ffn if not m.experts else 4 * h) + self.draft_vocab * h

    def draft(self, B: float, k: int) -> float:
        if k == 0:
            return 0.0
        hw = self.hw
        t_mem = self.weight_bytes * self.draft_params / self.tp / (hw.mem_bw * hw.mem_eff)
        t_flop = 2 * self.draft_params * B / (self.tp * self.flops * hw.flop_eff)
        step = hw.draft_overhead + max(t_mem, t_flop)
        return (k + 1) * step  # k drafts + feeding back the verified features

    def overhead(self, B: float, k: int) -> float:
        return 0.0  # sampling and verification run on the GPU inside step_overhead

    def iteration(self, B: float, k: int, ctx: float) -> float:
        return self.target(B, k + 1, ctx) + self.draft(B, k) + self.overhead(B, k)

    def prefill(self, B: float, prompt: float) -> float:
        return self.target(B, prompt, prompt / 2)
