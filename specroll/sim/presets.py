"""Named simulator set-ups: the paper's two 8B runs and the 235B projection.

**paper-8b-rl-zero / paper-8b-rl-think** (arXiv 2604.26779, research/paper_nemo_rl.md):
Qwen3-8B GRPO on DAPO-Math-17K, 32 GB200 colocated, EAGLE-3 at k = 3.

* From the paper: model, GPUs, k, acceptance lengths at k = 3, 5, 7 (per-position
  acceptance fitted to the three: `Speculation.from_acceptance_lengths`), and the AR
  log-prob / train / prepare stage times (they do not depend on speculation).
* Assumed (not published; public recipe facts): 512 prompts x 16 samples (DAPO), prompts
  of 200 tokens, one vLLM replica per GPU (TP = 1), half of each GPU's memory for the KV
  cache, log-normal response lengths with sigma 0.8 capped at 8k tokens (RL-Zero,
  a base model) or 16k tokens (RL-Think, a reasoning model).
* Calibrated (`benchmarks/sim_paper.py` fits them and prints the residuals; the values
  are frozen here): the GB200 efficiency factors (`flop_eff`, `step_overhead`,
  `draft_overhead`) on the RL-Zero k-sweep generation times only; each workload's
  mean response length on its *AR* generation time; the learner MFUs and the prepare
  cost on the RL-Zero AR stage times.
* Held out (predicted, never fitted): every RL-Think speculative number (the 1.54x
  generation and 1.35x step speed-ups, the k = 5 / 7 slowdowns) and both step
  speed-ups.

**qwen3-235b-2048-async**: Qwen3-235B-A22B on 2048 GB200, generation and training on
separate GPUs (1536 / 512), async with lag 2, the paper's projection point (k = 5,
acceptance length 4; rollout batch 4096 = 256 prompts x 16; FP8 rollouts). Assumed:
GB200 efficiency factors carried over from the 8B calibration (FP8 doubles the peak),
generation replicas TP 4 x EP 8 (32 GPUs; an NVL72 domain holds two), responses
log-normal with mean 8k tokens capped at 32k, the learner at Megatron-Core's published
MoE training MFU.
"""

from __future__ import annotations

from dataclasses import replace

from specroll.sim.catalogue import HARDWARE, MODELS
from specroll.sim.rlstep import Cluster, LearnerCost, Pipeline, RLSim
from specroll.sim.rollout import Speculation, Workload

# fitted by benchmarks/sim_paper.py (see its docstring); frozen so runs are reproducible
GB200_FIT = {"flop_eff": 0.2, "mem_eff": 0.9, "step_overhead": 1e-3, "draft_overhead": 5e-4}
ZERO_MEAN_LEN = 4246.0
THINK_MEAN_LEN = 3921.0
"""Mean of the uncapped log-normal: RL-Think's cap is twice RL-Zero's, so a lower mean
still gives it the longer tail its 1.34x longer AR generation needs."""
LEARNER_FIT = {"logprob_mfu": 0.366, "train_mfu": 0.624, "prepare_fixed_s": 1.9}

PAPER = {
    "paper-8b-rl-zero": {
        "acceptance_lengths": {3: 3.32, 5: 4.35, 7: 5.06},
        "stages_ar": {"prepare": 1.9, "gen": 100.0, "logprob": 17.8, "train": 31.3},
        "stages_spec": {"prepare": 2.1, "gen": 56.6, "logprob": 18.1, "train": 30.5},
        "gen_speedup": {3: 1.77, 5: 1.44, 7: 1.21},
        "step_speedup": 1.41,
    },
    "paper-8b-rl-think": {
        "acceptance_lengths": {3: 2.77, 5: 3.23, 7: 3.48},
        "stages_ar": {"prepare": 2.1, "gen": 133.6, "logprob": 17.9, "train": 31.4},
        "stages_spec": {"prepare": 1.6, "gen": 87.0, "logprob": 18.1, "train": 30.5},
        "gen_speedup": {3: 1.54, 5: 0.84, 7: 0.71},
        "step_speedup": 1.35,
    },
}
"""The paper's published figures (research/paper_nemo_rl.md §1.2-1.5)."""


def gb200(**fit: float):
    return replace(HARDWARE["gb200"], **{**GB200_FIT, **fit})


def paper_8b(kind: str, k: int = 3, **fit: float) -> RLSim:
    """RL-Zero ('zero') or RL-Think ('think') at draft depth k."""
    name = f"paper-8b-rl-{kind}"
    if name not in PAPER:
        raise ValueError(f"kind must be 'zero' or 'think', got {kind!r}")
    mean_len = fit.pop("mean_len", ZERO_MEAN_LEN if kind == "zero" else THINK_MEAN_LEN)
    learner = {**LEARNER_FIT, **{k_: fit.pop(k_) for k_ in list(fit) if k_ in LEARNER_FIT}}
    return RLSim(
        model=MODELS["qwen3-8b"],
        hw=gb200(**fit),
        cluster=Cluster(gpus=32, gen_tp=1, max_seqs=1024, kv_frac=0.5),
        workload=Workload(
            prompts=512,
            samples=16,
            prompt_len=200,
            mean_len=mean_len,
            sigma=0.8,
            max_len=8192 if kind == "zero" else 16384,
        ),
        spec=Speculation.from_acceptance_lengths(PAPER[name]["acceptance_lengths"], k=k),
        learner=LearnerCost(**learner),
        pipeline=Pipeline(lag=0),
    )


MOE_TRAIN_MFU = 919e12 / 2500e12
"""Megatron-Core MoE training of Qwen3-235B on GB200 (919 TFLOP/s per GPU; research/
simulator.md §3); log-prob keeps the 8B calibration's log-prob / train MFU ratio."""


def projection_235b(k: int = 5, acceptance_length: float = 4.0, lag: int = 2) -> RLSim:
    """Qwen3-235B-A22B on 2048 GB200, async, FP8 rollouts (the paper's Fig. 4 point)."""
    ratio = LEARNER_FIT["logprob_mfu"] / LEARNER_FIT["train_mfu"]
    return RLSim(
        model=MODELS["qwen3-235b-a22b"],
        hw=gb200(),
        weight_bytes=1,  # FP8 rollouts
        cluster=Cluster(gpus=2048, gen_gpus=1536, gen_tp=4, gen_ep=8, kv_frac=0.5),
        workload=Workload(
            prompts=256, samples=16, prompt_len=200, mean_len=8000, sigma=0.8, max_len=32768
        ),
        spec=Speculation.from_acceptance_length(acceptance_length, k),
        learner=LearnerCost(
            logprob_mfu=MOE_TRAIN_MFU * ratio,
            train_mfu=MOE_TRAIN_MFU,
            prepare_fixed_s=LEARNER_FIT["prepare_fixed_s"],
            draft_online=True,
        ),
        pipeline=Pipeline(lag=lag),
    )


PRESETS = {
    "paper-8b-rl-zero": lambda: paper_8b("zero"),
    "paper-8b-rl-think": lambda: paper_8b("think"),
    "qwen3-235b-2048-async": projection_235b,
}


def preset(name: str) -> RLSim:
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is not one of {sorted(PRESETS)}")
    return PRESETS[name]()
