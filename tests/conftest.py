"""Shared fixtures and helpers: tiny randomly initialised models of each architecture (no
downloads), trainers and learners of the tiny preset, and the exactness machinery of the
speculative-decoding chi-square tests (tests/test_spec_engine.py, test_gpu.py, test_vllm.py).

specroll is imported inside the helpers, so collecting any test module stays light.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from specroll.drafting.eagle3_head import Eagle3Head
    from specroll.drafting.mtp_heads import MTPDraft
    from specroll.model import Transformer
    from specroll.rl.learner.learner import Learner

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per pytest-xdist worker (`-n 2` on 2 cores): OpenMP threads of two workers
    # spinning on the same cores slow both; processes the tests start inherit the setting
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# (name, transformers config class name, extra config fields)
VARIANTS = {
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-untied-mha": ("LlamaConfig", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3-qknorm": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3Config", dict(tie_word_embeddings=False, num_key_value_heads=1)),
}


def make_hf_model(variant: str, seed: int = 0):
    """A tiny transformers model with non-trivial weights (biases and norms randomised)."""
    import transformers

    cls_name, extra = VARIANTS[variant]
    cfg = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, tuple[object, str]]:
    """variant → (transformers model, saved directory)."""
    out = {}
    for v in VARIANTS:
        model = make_hf_model(v)
        d = tmp_path_factory.mktemp(v)
        model.save_pretrained(d)
        out[v] = (model, str(d))
    return out


@pytest.fixture(scope="session")
def tiny_model(hf_dirs):
    """A specroll Transformer loaded from the tiny Llama directory."""
    from specroll.model import load_model

    return load_model(hf_dirs["llama-tied"][1])


def assert_greedy_matches_hf(ours, hf, prompts: list[list[int]], n: int = 64) -> None:
    """specroll's engine and transformers' `generate` agree on n greedy tokens per prompt."""
    from specroll.engine import Engine, Request, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=())
    results = Engine(ours).generate([Request(p, params) for p in prompts])
    for p, r in zip(prompts, results, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert r.token_ids == out[0, len(p) :].tolist()


@pytest.fixture()
def tiny_setup(tmp_path, monkeypatch):
    """(policy, tokenizer) of the tiny preset, built into a fresh SPECROLL_HOME."""
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    from specroll.model import load_model
    from specroll.model.hub import resolve
    from specroll.model.tokenizer import Tokenizer

    d = resolve("tiny")
    return load_model(d), Tokenizer(d)


def make_trainer(setup, out, *overrides, log=None, preset="tiny"):
    """A Trainer of `preset` on `setup` = (policy, tokenizer), writing into `out`, with its
    draft built as `specroll train` builds it; quiet unless given a `log`."""
    from specroll.rl.config import build_config
    from specroll.rl.run.draft import build_draft
    from specroll.rl.run.trainer import Trainer

    policy, tok = setup
    cfg = build_config(preset, [f"pipeline.out_dir={out}", *overrides])
    draft = build_draft(cfg, policy, tok, Path(out).parent)
    return Trainer(cfg, policy, tok, draft, log=log or (lambda m: None))


def step_batch(trainer, samples: int = 2):
    """Step 0's prompts with `samples` rollouts each, generated by the trainer's backend, as
    a batch with +-1 advantages."""
    from specroll.rl.algo.batch import Batch

    task = trainer.task
    results = trainer.rollout.generate(task.requests(task.problems(0), samples, base_seed=5))
    return Batch.from_results(results, torch.tensor([1.0, -1.0] * (len(results) // 2)))


def learner(policy, *overrides: str, draft=None) -> Learner:
    """The learner a run of the tiny preset builds (micro-batches of 4), on the CPU."""
    from specroll.rl.config import build_config
    from specroll.rl.learner.build import build_learner

    cfg = build_config("tiny", ["policy.micro_batch=4", "learner.device=cpu", *overrides])
    return build_learner(cfg, policy, draft)


# ---------------------------------------------------------------- exactness (chi-square)
# The joint distribution of the first three tokens generated after PROMPT, sampled with
# speculation, against plain decoding's exact joint, enumerated on a VOCAB-id vocabulary.

VOCAB = 16
PROMPT = [3, 7, 1, 3, 7, 2, 3, 7]  # repetitive, so the n-gram drafter finds matches
JOINT_SAMPLES = 30_000  # samples per chi-square test: enough to reject a 2% TV shift


def spec_model(seed: int, std: float = 0.4) -> Transformer:
    """The chi-square tests' target: a random 4-layer Transformer over VOCAB ids (256
    positions), in fp32 on the CPU, in eval mode."""
    from specroll.model import ModelConfig, Transformer

    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
    )
    return Transformer(cfg).init_weights(seed=seed, std=std).eval()


def related_draft(target: Transformer, noise: float = 0.15) -> Transformer:
    """A draft close to the target `spec_model(0)` (like a distilled one): accepts some,
    rejects some. Built in fp32 on the CPU."""
    draft = spec_model(0)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return draft


def _like(target: Transformer, module: torch.nn.Module) -> torch.nn.Module:
    """`module` (a draft network) on the target's device and in its dtype."""
    from specroll.model.weights import for_inference

    p = next(target.parameters())
    return for_inference(module, p.device, p.dtype)


def _eagle3(target: Transformer) -> Eagle3Head:
    from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head

    head = Eagle3Head(Eagle3Config.for_target(target.cfg, 12), embed=target)
    return head.init_weights(3, 0.3)


def _mtp(target: Transformer) -> MTPDraft:
    from specroll.drafting.mtp_heads import MTPConfig, MTPDraft

    return MTPDraft(MTPConfig.for_target(target.cfg, num_mtp=2), target).init_weights(4, 0.3)


def spec_drafters(target: Transformer) -> dict[str, Callable[[], object]]:
    """Drafter factories on `target` by name (ngram, draft_model, oracle, eagle3, mtp);
    draft networks (built and initialised on the CPU in fp32) run on the target's device
    and in its dtype."""
    from specroll.drafters.draft_model import DraftModelDrafter
    from specroll.drafters.eagle3 import Eagle3Drafter
    from specroll.drafters.mtp import MTPDrafter
    from specroll.drafters.ngram import NgramDrafter

    return {
        "ngram": lambda: NgramDrafter(n_max=2),
        "draft_model": lambda: DraftModelDrafter(_like(target, related_draft(target))),
        "oracle": lambda: DraftModelDrafter(target),
        # random-init heads: exactness must not depend on the draft being any good
        "eagle3": lambda: Eagle3Drafter(_like(target, _eagle3(target))),
        "mtp": lambda: MTPDrafter(_like(target, _mtp(target))),
    }


def exact_joint(model, t: float, k: int, p: float, n: int = 3) -> torch.Tensor:
    """P(y1..yn | PROMPT) of plain decoding at temperature t, top-k k, top-p p, enumerated
    from the model's own fp32 logits (a bf16 model's: upcast, as the engine samples them):
    float64 [VOCAB**n], indexed y1 * VOCAB**(n-1) + ... + yn, on the model's device."""
    from specroll.spec.sampling import RowSampling, probs_from_logits

    dev = next(model.parameters()).device
    seqs = list(itertools.product(range(VOCAB), repeat=n - 1))
    seqs = torch.tensor(seqs, device=dev)  # [V^(n-1), n-1]
    full = torch.cat([torch.tensor(PROMPT, device=dev).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = model(full).logits[:, len(PROMPT) - 1 :]  # [M, n, V] fp32
    M = len(seqs)
    rows = RowSampling.full(M, t, k, p, device=dev)
    probs = probs_from_logits(logits, rows).double()  # [M, n, V]
    joint = torch.ones(M, dtype=torch.float64, device=dev)
    for i in range(n - 1):  # P(y1..y_{n-1}) for each prefix
        joint = joint * probs[torch.arange(M, device=dev), i, seqs[:, i]]
    return (joint.unsqueeze(1) * probs[:, n - 1]).flatten()  # [V^n]


def sample_joint(engine, n_samples: int, t: float, k: int, p: float, mixed: bool) -> torch.Tensor:
    """Counts [VOCAB**3] (indexed as `exact_joint`'s) of the first three tokens of
    `n_samples` requests for PROMPT (seeds 0..n_samples-1) generated by `engine`; `mixed`
    caps the draft length of the rows at 0, 1, 2, 3 in turn, side by side in a batch."""
    from specroll.engine import Request, SamplingParams

    reqs = []
    for i in range(n_samples):
        cap = (i % 4) if mixed else None  # k = 0, 1, 2, 3 rows side by side
        params = SamplingParams(
            t, top_k=k, top_p=p, max_new_tokens=5, stop_token_ids=(), seed=i, max_draft=cap
        )
        reqs.append(Request(PROMPT, params))
    # 5 tokens, of which the first 3 are counted: a row drafts no more than its budget
    # can keep, and after the prefill token 4 to go leave room for the full 3 drafts
    res = engine.generate(reqs)
    ids = torch.tensor([r.token_ids[:3] for r in res])  # [N, 3]
    return torch.bincount(ids[:, 0] * VOCAB**2 + ids[:, 1] * VOCAB + ids[:, 2], minlength=VOCAB**3)


def chi2_sf(x: float, dof: int) -> float:
    """Survival function of chi-square: Q(dof/2, x/2), the regularised upper gamma."""
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(
        torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(x / 2.0, dtype=torch.float64)
    ).item()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of `counts` against `probs`, with the cells of expected
    count < 5 pooled into one; asserts that no cell of probability zero was sampled."""
    n = counts.sum().item()
    exp = probs * n
    assert counts[probs == 0].sum() == 0, "sampled a sequence of probability zero"
    big = exp >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    e = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = e > 0
    stat = ((obs[keep] - e[keep]) ** 2 / e[keep]).sum().item()
    return chi2_sf(stat, int(keep.sum()) - 1)


def tv_shifted(probs: torch.Tensor, tv: float) -> torch.Tensor:
    """The power control: `probs` with `tv` mass moved from the likeliest cell to the
    second likeliest (a distribution `tv` away in total variation)."""
    out = probs.clone()
    a, b = probs.argsort(descending=True)[:2]
    out[a] -= tv
    out[b] += tv
    return out


def gof_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts against probs (bins with mass only)."""
    n = counts.sum().item()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token with zero probability"
    exp = probs[support].double() * n
    stat = ((counts[support].double() - exp) ** 2 / exp).sum().item()
    return chi2_sf(stat, int(support.sum()) - 1)


# ---------------------------------------------------------------------- the command line


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """SPECROLL_HOME in the test's own directory: models and drafts are built there."""
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))


def train_tiny(out, *args: str) -> int:
    """`specroll train --preset tiny --out OUT ARGS`, in this process; its exit code."""
    from specroll.cli import main

    return main(["train", "--preset", "tiny", "--out", str(out), *args])


def err_text(capsys) -> str:
    """What the command wrote to stderr, as one line (rich wraps long lines)."""
    return " ".join(capsys.readouterr().err.split())


def fails_clearly(capsys, argv: list[str], *needles: str) -> str:
    """main(argv) exits 2, ending with one `error:` line that holds every needle (progress
    lines such as 'loading ...' may come before it), and prints no traceback."""
    from specroll.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("error: ") and err.endswith(last + "\n"), err
    for needle in needles:
        assert needle in last, err
    return last
