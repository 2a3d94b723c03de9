"""One RL step, simulated: generation (AR and speculative), log-prob, train, weight sync,
in a synchronous or asynchronous pipeline.

* **Generation** runs on `gen_replicas` replicas (a TP x EP group each) with continuous
  batching (`rollout.simulate_replica`); concurrency per replica is the smaller of
  `max_seqs` and what the KV cache holds at the workload's mean context. A synchronous
  step waits for the slowest replica.
* **Log-prob and train** are FLOP-bound passes over every prompt + response token:
  2 x active params (forward) and 6 x (forward + backward), at an MFU calibrated per pass
  (log-prob runs at a lower MFU than FLOPs alone suggest: research/simulator.md §3).
* **FSDP communication** (the learner sharded over its R = train GPUs): each rank
  all-gathers (R-1)/R of the bf16 weights for every forward (log-prob: one per
  micro-batch; train: the forward and again the backward) and reduce-scatters (R-1)/R of
  the fp32 gradients per micro-batch, over NVLink within a domain and the inter-node link
  beyond it. Prefetching hides it behind compute up to `comm_overlap`; what is left adds
  to the pass (`learner_comm`).
* **Prepare** (weight sync): a fixed cost plus the bf16 weights (and the draft, if it is
  trained online) over the sync path.
* **Async with lag L** (generation on its own GPUs): rollouts for steps t+1..t+L run
  while the learner trains step t, so the engine never drains: the tail of one step's
  batch is filled with the next step's requests. Generation time per step is then the
  time of L+1 steps' requests back to back over L+1, and the step time is
  max(generation, learner) — the learner waits only for the exposed part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from specroll.sim.catalogue import HardwareSpec, ModelSpec
from specroll.sim.rollout import Speculation, Workload, simulate_rollout
from specroll.sim.stepmodel import BYTES, AnalyticStep


@dataclass
class Cluster:
    """GPUs per role and generation parallelism."""

    gpus: int = 32
    """GPUs in the job."""
    gen_gpus: int = 0
    """GPUs that only generate (async / disaggregated); 0 = colocated (all GPUs
    generate, then all train)."""
    gen_tp: int = 1
    """Tensor parallelism of one generation replica."""
    gen_ep: int = 1
    """Expert parallelism of one generation replica (MoE)."""
    max_seqs: int = 1024
    """Most sequences one replica runs at once (vLLM max_num_seqs)."""
    kv_frac: float = 0.5
    """Share of a generation GPU's memory given to the KV cache."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"cluster.gpus must be >= 1, got {self.gpus}")
        if not 0 <= self.gen_gpus < self.gpus:
            raise ValueError(
                f"cluster.gen_gpus must be in [0, gpus={self.gpus}), got {self.gen_gpus}"
            )
        if self.generation_gpus % (self.gen_tp * self.gen_ep):
            raise ValueError(
                f"generation GPUs ({self.generation_gpus}) must be a multiple of "
                f"gen_tp x gen_ep ({self.gen_tp} x {self.gen_ep})"
            )
        if not 0 < self.kv_frac < 1:
            raise ValueError(f"cluster.kv_frac must be in (0, 1), got {self.kv_frac}")

    @property
    def generation_gpus(self) -> int:
        return self.gen_gpus or self.gpus

    @property
    def train_gpus(self) -> int:
        return self.gpus - self.gen_gpus

    @property
    def replicas(self) -> int:
        return self.generation_gpus // (self.gen_tp * self.gen_ep)


@dataclass
class LearnerCost:
    """Efficiency of the learner passes and of the weight sync."""

    logprob_mfu: float = 0.25
    """Share of peak FLOP/s the log-prob recomputation reaches."""
    train_mfu: float = 0.35
    """Share of peak FLOP/s the training pass reaches."""
    prepare_fixed_s: float = 1.0
    """Weight-sync fixed cost (resharding, cache reset, graph recapture)."""
    draft_online: bool = False
    """The draft is trained every step (its weights are synced too)."""
    fsdp: bool = True
    """The learner shards weights, gradients and optimizer state with FSDP over its GPUs."""
    micro_batches: int = 1
    """Micro-batches per rank per step (each one's forward and backward gathers again)."""
    inter_node_bw: float = 50e9
    """Bytes/s per GPU between nodes (400 Gb/s): the ring's link once ranks span domains."""
    comm_overlap: float = 0.9
    """Most of the FSDP communication prefetching hides behind compute (the rest shows)."""


@dataclass
class Pipeline:
    """Synchronous or asynchronous RL."""

    lag: int = 0
    """Policy lag: 0 = synchronous; L >= 1 = generation runs up to L steps ahead."""

    def __post_init__(self) -> None:
        if self.lag < 0:
            raise ValueError(f"pipeline.lag must be >= 0, got {self.lag}")


@dataclass
class RLSim:
    """Everything one simulated RL step needs."""

    model: ModelSpec
    hw: HardwareSpec
    cluster: Cluster = field(default_factory=Cluster)
    workload: Workload = field(default_factory=Workload)
    spec: Speculation = field(default_factory=Speculation)
    learner: LearnerCost = field(default_factory=LearnerCost)
    pipeline: Pipeline = field(default_factory=Pipeline)
    weight_bytes: float = 2
    """Bytes per generation weight (1 = FP8 rollouts; the learner stays bf16)."""
    draft_size: float = 0.0
    """Drafter parameters (0 = one EAGLE-3 / MTP layer of the model; else a draft model)."""
    step: object | None = None
    """Step-time model override (a measured `CostModel`); default: `AnalyticStep`."""

    def step_model(self):
        if self.step is not None:
            return self.step
        c = self.cluster
        return AnalyticStep(
            self.model,
            self.hw,
            tp=c.gen_tp,
            ep=c.gen_ep,
            weight_bytes=self.weight_bytes,
            draft_size=self.draft_size,
        )

    def concurrency(self) -> int:
        """Sequences per replica: max_seqs, or what the KV cache holds at mean context."""
        c, m, w = self.cluster, self.model, self.workload
        if self.step is not None:
            return c.max_seqs
        group = c.gen_tp * c.gen_ep
        weights = self.weight_bytes * m.params_total
        kv_bytes = group * self.hw.mem_gb * 1e9 * c.kv_frac
        kv_bytes = min(kv_bytes, group * self.hw.mem_gb * 1e9 * 0.9 - weights)
        mean_ctx = w.prompt_len + min(w.mean_len, w.max_len)
        fits = int(kv_bytes / (m.kv_bytes_per_token * mean_ctx))
        if fits < 1:
            raise ValueError(
                f"{m.name} on {group} x {self.hw.name}: the KV cache of one sequence at "
                f"{mean_ctx:.0f} tokens does not fit (raise cluster.kv_frac or gen_tp)"
            )
        return min(c.max_seqs, fits)

    def generation(self, spec: Speculation, lengths: np.ndarray) -> dict:
        """Generation seconds per step (slowest replica), its trace and depth histogram."""
        lengths = np.asarray(lengths, dtype=np.float64)  # [n]; callers may pass lists/tensors
        w = self.workload
        steps = self.pipeline.lag + 1
        if steps > 1:  # async: L+1 steps' requests back to back, no drain in between
            extra = [
                Workload(**{**asdict(w), "seed": w.seed + s + 1, "lengths": None}).draw()
                for s in range(steps - 1)
            ]
            lengths = np.concatenate([lengths, *extra])
        batch = self.concurrency()
        out = simulate_rollout(
            self.step_model(), lengths, self.cluster.replicas, batch, w.prompt_len, spec
        )
        return {**out, "gen_s": out["gen_s"] / steps, "concurrency": batch}

    def learner_stages(self, tokens: float) -> dict:
        """Log-prob, train and prepare seconds for `tokens` prompt + response tokens."""
        m, hw, lc = self.model, self.hw, self.learner
        flops = self.cluster.train_gpus * hw.flops
        # weights only: attention FLOPs are small next to them at these contexts
        logprob = 2 * m.params_active * tokens / (flops * lc.logprob_mfu)
        train = 6 * m.params_active * tokens / (flops * lc.train_mfu)
        comm = self.learner_comm()
        logprob += _exposed(comm["logprob_s"], logprob, lc.comm_overlap)
        train += _exposed(comm["train_s"], train, lc.comm_overlap)
        sync_bytes = BYTES * m.params_total * (1.05 if lc.draft_online else 1.0)
        prepare = lc.prepare_fixed_s + sync_bytes / self.cluster.generation_gpus / hw.link_bw
        return {"logprob": logprob, "train": train, "prepare": prepare}

    def learner_comm(self) -> dict:
        """FSDP traffic per rank per step: all-gather and reduce-scatter bytes, and the
        seconds it takes in the log-prob and the train pass (before overlap)."""
        R, lc = self.cluster.train_gpus, self.learner
        if not lc.fsdp or R == 1:
            return {"gather_bytes": 0.0, "scatter_bytes": 0.0, "logprob_s": 0.0, "train_s": 0.0}
        share = (R - 1) / R * self.model.params_total  # parameters a rank does not hold
        mb = lc.micro_batches
        gather_lp, gather_train = share * BYTES * mb, share * BYTES * 2 * mb
        scatter = share * 4 * mb  # fp32 gradients
        bw = self.hw.link_bw if R <= self.hw.domain else lc.inter_node_bw
        return {
            "gather_bytes": gather_lp + gather_train,
            "scatter_bytes": scatter,
            "logprob_s": gather_lp / bw,
            "train_s": (gather_train + scatter) / bw,
        }

    def tokens(self, lengths: np.ndarray) -> float:
        """Prompt + response tokens the learner processes in one step."""
        lengths = np.asarray(lengths, dtype=np.float64)  # [n]
        return float(lengths.sum()) + len(lengths) * self.workload.prompt_len

    def stages(self, gen_s: float, learn: dict) -> dict:
        """Stage seconds and the step time. Synchronous: the sum. Async: generation overlaps
        the learner, which waits only for the exposed part (max(0, gen - learner))."""
        stages = {"gen": gen_s, **learn}
        learner_s = sum(learn.values())
        if self.pipeline.lag:
            stages["exposed_gen"] = max(0.0, gen_s - learner_s)
            stages["step"] = learner_s + stages["exposed_gen"]
        else:
            stages["step"] = gen_s + learner_s
        return stages

    def run(self) -> dict:
        """Stage breakdown with and without speculation, speed-ups and the Amdahl bound."""
        w = self.workload
        lengths = w.draw()
        learn = self.learner_stages(self.tokens(lengths))
        out = {}
        for name, spec in (("ar", Speculation()), ("spec", self.spec)):
            gen = self.generation(spec, lengths)
            keep = ("iterations", "depth_hist", "trace", "concurrency")
            out[name] = {"stages": self.stages(gen["gen_s"], learn), **{k: gen[k] for k in keep}}
        ar, sp = out["ar"]["stages"], out["spec"]["stages"]
        # the bound (paper §1.1) is for a synchronous step: generation's share of it
        share = ar["gen"] / ar["step"] if not self.pipeline.lag else None
        al = self.spec.tau(self.spec.k)
        return {
            "gen_speedup": ar["gen"] / sp["gen"],
            "step_speedup": ar["step"] / sp["step"],
            "amdahl_bound": None if share is None else 1 / (share / al + 1 - share),
            "gen_share_ar": share,
            "acceptance_length": al,
            "stages_ar": ar,
            "stages_spec": sp,
            "concurrency": out["ar"]["concurrency"],
            "depth_hist_spec": out["spec"]["depth_hist"],
            "trace_ar": out["ar"]["trace"],
            "trace_spec": out["spec"]["trace"],
            "learner_comm": self.learner_comm(),
            "mean_len": float(lengths.mean()),
            "samples": len(lengths),
        }


def _exposed(comm_s: float, compute_s: float, overlap: float) -> float:
    """Communication seconds a pass shows: what compute cannot hide, and at least the
    share prefetching never hides (the first block's gather, the last reduce-scatter)."""
    return max(comm_s - compute_s, (1 - overlap) * comm_s)
