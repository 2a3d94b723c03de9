"""Every tensor the engine makes is made on its model's device: the device-leak harness.

A tensor constructed without `device=` lands on torch's default device. Under
`tensors_need_a_device()` that default is `meta`, a device with shapes but no data: any
such tensor makes the next real operation on it (mixing it with the model's tensors,
reading it with `int()` / `.tolist()`) raise. So a run that passes under the harness made
every tensor on purpose — on the model's device, or explicitly on the host — which is
what a GPU run needs, checked on a CPU-only machine.

Models are built on the CPU first (building modules follows the default device, as torch
intends); only the rollout itself runs under the harness. Other suites import the
harness: `from tests.test_devices import meta_default, tensors_need_a_device`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest
import torch

import specroll.engine.iteration as engine_module
from specroll.drafters.draft_model import DraftModelDrafter
from specroll.drafters.eagle3 import Eagle3Drafter
from specroll.drafters.mtp import MTPDrafter
from specroll.drafters.ngram import NgramDrafter
from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head
from specroll.drafting.mtp_heads import MTPConfig, MTPDraft
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.costmodel import CostModel
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.model.weights import for_inference
from tests.conftest import PROMPT, make_trainer, related_draft, spec_model
from tests.test_learner import learner, tiny_batch, tiny_policy
from tests.test_ray import TIMING

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DRAFTERS = ["plain", "ngram", "draft_model", "eagle3", "mtp"]


@contextmanager
def tensors_need_a_device(default: str = "meta") -> Iterator[None]:
    """Make `default` (meta) torch's default device inside; the previous default comes
    back on exit, also when the body raises."""
    before = torch.get_default_device()
    torch.set_default_device(default)
    try:
        yield
    finally:
        # cpu is torch's own default: unset it rather than install a cpu device context
        torch.set_default_device(None if before == torch.device("cpu") else before)


@pytest.fixture
def meta_default() -> Iterator[None]:
    """The test body runs under `tensors_need_a_device()`."""
    with tensors_need_a_device():
        yield


# ---------------------------------------------------------------------- the harness


def test_the_harness_restores_the_default_device_even_on_failure():
    assert torch.get_default_device() == torch.device("cpu")
    with pytest.raises(ZeroDivisionError), tensors_need_a_device():
        assert torch.zeros(1).device.type == "meta"
        assert torch.zeros(1, device="cpu").device.type == "cpu"  # explicit: unaffected
        _ = 1 / 0
    assert torch.get_default_device() == torch.device("cpu")
    assert torch.zeros(1).device.type == "cpu"


# ---------------------------------------------------------------------- the engine


def _requests(n: int = 7) -> list[Request]:
    """More requests than slots (admission, compaction), at T = 1, T = 0 and T = 0.8 with
    top-k / top-p, prompts of several lengths, a stop token and per-request draft caps."""
    settings = [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.8, 4, 0.9)]
    reqs = []
    for i in range(n):
        t, k, p = settings[i % 3]
        params = SamplingParams(
            t,
            top_k=k,
            top_p=p,
            max_new_tokens=10 + 2 * i,
            stop_token_ids=(3,) if i % 2 else (),
            seed=i,
            max_draft=[None, 1, 0][i % 3],
        )
        reqs.append(Request(PROMPT[: 3 + i % 6], params))
    return reqs


def _engine(kind: str, device: str, dtype: torch.dtype, adaptive: bool = False) -> Engine:
    """An engine on a tiny target placed on (device, dtype), built outside the harness."""
    target = for_inference(spec_model(0), device, dtype)
    net: torch.nn.Module | None = None
    if kind == "plain":
        return Engine(target, EngineConfig(max_batch=3))
    if kind == "ngram":
        drafter = NgramDrafter(n_max=2)
    elif kind == "draft_model":
        net = for_inference(related_draft(spec_model(0)), device, dtype)
        drafter = DraftModelDrafter(net)
    elif kind == "eagle3":
        head = Eagle3Head(Eagle3Config.for_target(target.cfg, 12)).init_weights(3, 0.3)
        drafter = Eagle3Drafter(for_inference(head.set_embedding(target), device, dtype))
    else:
        mtp = MTPDraft(MTPConfig.for_target(target.cfg, num_mtp=2), target)
        mtp.init_weights(4, 0.3)  # heads built and initialised on the CPU, then placed
        drafter = MTPDrafter(for_inference(mtp, device, dtype))
    cost = CostModel(fixed=1e-3, per_token=1e-5, knee=4, draft_step=1e-5)
    depth = AdaptiveDepth(cost, k_max=3) if adaptive else FixedDepth(3)
    return Engine(target, EngineConfig(max_batch=3), drafter, depth)


def _outputs(results) -> list[tuple]:
    return [(r.token_ids, r.logprobs, r.finish_reason, r.spec.accepted_tokens) for r in results]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("device", DEVICES)
def test_engine_makes_no_tensor_off_its_device(kind, device, dtype):
    """Plain and speculative decoding with every drafter, twice on one engine (cache and
    drafter state reused), under the harness; the outputs are those of a run without it
    (the harness changes where a stray tensor lands, never a computation)."""
    eng = _engine(kind, device, DTYPES[dtype])
    reqs = _requests()
    with tensors_need_a_device():
        first = eng.generate(reqs)
        eng.load_weights(1, eng.model.state_dict())  # weight sync: copy in place, repack
        second = eng.generate(reqs)
    assert eng.cache.k.device.type == device and eng.cache.k.dtype == DTYPES[dtype]
    if kind != "plain":
        assert eng.stats.draft_tokens > 0
    assert _outputs(first) == _outputs(second)
    assert {r.policy_version for r in second} == {1}
    assert _outputs(eng.generate(reqs)) == _outputs(first)


@pytest.mark.filterwarnings("ignore:the hardware profile disagrees")  # a made-up profile
@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_adaptive_depth_makes_no_tensor_off_its_device(kind):
    """The adaptive depth policy reads the verifier's acceptances (FixedDepth ignores them).

    Each iteration is timed as the profile predicts, so the choices rest on the
    acceptances alone: with wall times, a slow machine measures drafting as a loss and
    stops before the n-gram drafter finds a match, which says nothing about devices."""
    eng = _engine(kind, "cpu", torch.float32, adaptive=True)
    depth, observe = eng.depth, eng.depth.observe_time
    depth.observe_time = lambda b, k, ctx, _s: observe(b, k, ctx, depth.cost.iteration(b, k, ctx))
    with tensors_need_a_device():
        eng.generate(_requests(9))
    assert eng.stats.draft_tokens > 0 and eng.depth.reached.sum() > 0


def test_a_tensor_made_without_a_device_fails_the_harness(monkeypatch):
    """The harness has teeth: one stray constructor in the engine's step (here after the
    verifier) makes the run raise under it, while the same run passes without it."""
    verify = engine_module.verify

    def leaky_verify(*args, **kwargs):
        out = verify(*args, **kwargs)
        out.num_accepted = out.num_accepted + torch.zeros(len(out.num_accepted), dtype=torch.long)
        return out

    monkeypatch.setattr(engine_module, "verify", leaky_verify)
    eng = _engine("ngram", "cpu", torch.float32)
    eng.generate(_requests())  # without the harness the stray tensor is a CPU one
    with pytest.raises((RuntimeError, NotImplementedError)), tensors_need_a_device():
        eng.generate(_requests())
    assert torch.get_default_device() == torch.device("cpu")


def test_meta_default_fixture_applies_to_the_body(meta_default):
    assert torch.empty(2).device.type == "meta"


# ---------------------------------------------------------------------- the learner and a step


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_learner_step_makes_no_tensor_off_its_device(dtype):
    """Log-prob recomputation and an update of policy and online EAGLE-3 draft (optimizer
    state made on the first step) under the harness, equal to the same step without it."""

    def step(harness: bool) -> tuple[torch.Tensor, dict, torch.Tensor]:
        policy = tiny_policy()
        head = Eagle3Head(Eagle3Config.for_target(policy.cfg, 12)).init_weights(3, 0.3)
        name = str(DTYPES[dtype]).removeprefix("torch.")  # float32 | bfloat16
        lr = learner(policy, f"learner.dtype={name}", draft=head.set_embedding(policy))
        b = tiny_batch()
        with tensors_need_a_device() if harness else nullcontext():
            old = lr.logprobs(b)
            stats = lr.train(b, old)
            stats |= lr.train(b, old)  # a second update reads the optimizer state
        return old, stats, next(policy.parameters()).detach().clone()

    old, stats, w = step(True)
    want_old, want_stats, want_w = step(False)
    assert old.device.type == "cpu" and torch.equal(old, want_old)
    assert stats == want_stats and torch.equal(w, want_w)


def test_a_training_step_makes_no_tensor_off_its_device(tiny_setup, tmp_path):
    """Two steps of the tiny preset (rollouts with the online draft, rewards, advantages,
    the first step's log-prob agreement check, the update, the weight sync) under the
    harness; metrics as without it."""
    from specroll.model import load_model
    from specroll.model.hub import resolve

    runs = []
    for harness, out in ((True, tmp_path / "a"), (False, tmp_path / "b")):
        policy = load_model(resolve("tiny"))  # a fresh copy: training moves the weights
        t = make_trainer(
            (policy, tiny_setup[1]), out / "run", "data.val_size=0", "learner.check_every=2"
        )
        with tensors_need_a_device() if harness else nullcontext():
            runs.append([t.run_step() for _ in range(2)])
    for a, b in zip(*runs, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING} == {
            k: v for k, v in b.items() if k not in TIMING
        }
    assert runs[0][0]["logprob_check"] is True
