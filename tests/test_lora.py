"""LoRA policies (issue 48): only the adapters train; the engine serves the adapted policy
(merged into its weights, or adapters in its forward) and speculation stays exact with
respect to it; a refit carries only the adapters; checkpoints hold only the adapters and a
resumed run repeats the uninterrupted one; exports load in transformers and, as a PEFT
adapter, in peft; a run starts from a PEFT adapter and refuses one that does not fit."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specroll.engine import Engine, EngineConfig
from specroll.engine.depth import FixedDepth
from specroll.model import lora
from specroll.model.weights import load_state
from tests.conftest import (
    JOINT_SAMPLES,
    chi2_pvalue,
    err_text,
    exact_joint,
    make_trainer,
    sample_joint,
    spec_drafters,
    spec_model,
    train_tiny,
    tv_shifted,
)

SPEC = lora.LoraSpec(rank=4, alpha=8.0, targets=lora.expand_targets([lora.ALL]))


def _adapted(model, spec=SPEC, seed=0, std=0.3):
    """`model` with adapters whose B is random (a fresh adapter's B is zero: it would
    change nothing, and a test could not tell adapters served from adapters ignored)."""
    lora.attach(model, spec, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora.B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _served(policy, merged: bool):
    """The engine's copy of `policy` after a refit of its adapters (as `LocalRollout`)."""
    model = copy.deepcopy(policy).eval()
    served = lora.Served(model, merged=merged)
    load_state(model, served.state(lora.adapters(policy)), "policy", partial=True)
    return model


def test_adapters_start_at_zero_and_merge_to_the_same_function():
    """A fresh adapter leaves the policy bit for bit as it was (B = 0); trained ones
    merged into the weights give the adapters' logits to fp32 rounding."""
    base = spec_model(0)
    tokens = torch.randint(0, 16, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(tokens).logits
        fresh = lora.attach(copy.deepcopy(base), SPEC)
        assert torch.equal(fresh(tokens).logits, before)
        adapted = _adapted(copy.deepcopy(base))
        logits = adapted(tokens).logits
        merged = lora.merge(copy.deepcopy(adapted))(tokens).logits
    assert (logits - before).abs().max() > 0.1  # the adapters change the policy
    torch.testing.assert_close(merged, logits, rtol=1e-4, atol=1e-4)  # fp32 rounding


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "adapters"])
def test_speculation_through_the_engine_samples_the_adapted_policy(merged):
    """Chi-square of the first three tokens' joint distribution, sampled by the engine
    with a draft model close to the *base* (a frozen-base draft), against plain decoding
    of the adapted policy, enumerated from the learner's form of it (adapters in the
    forward). The control: the base policy's exact joint, which these counts reject."""
    target = _adapted(spec_model(0))
    model = _served(target, merged)
    assert (model.lora_spec is None) == merged
    draft = spec_drafters(spec_model(0))["draft_model"]()
    engine = Engine(model, EngineConfig(max_batch=512), drafter=draft, depth=FixedDepth(3))
    counts = sample_joint(engine, JOINT_SAMPLES, 1.0, 0, 1.0, mixed=True)
    assert engine.stats.draft_tokens > JOINT_SAMPLES // 2
    exact = exact_joint(target, 1.0, 0, 1.0)
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4
    assert chi2_pvalue(counts, exact_joint(spec_model(0), 1.0, 0, 1.0)) < 1e-6


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_only_the_adapters_train_and_hold_optimizer_state(tiny_setup, tmp_path, dtype):
    """The base stays bit for bit (fp32, and bf16 autocast over fp32 masters); the
    adapters move; the optimizer holds state for the adapters alone."""
    from tests.conftest import step_batch

    t = make_trainer(tiny_setup, tmp_path / "run", "lora.rank=4", f"learner.dtype={dtype}")
    base = {k: v.clone() for k, v in t.policy.state_dict().items() if ".lora." not in k}
    before = {k: v.clone() for k, v in lora.adapters(t.policy).items()}
    t.host.train(step_batch(t), None, None, lr=1e-3)
    after = t.policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    assert any(not torch.equal(after[k], v) for k, v in before.items())
    held = {id(p) for p in t.host.learner.opt.state}
    assert held and held == {id(p) for n, p in t.policy.named_parameters() if ".lora." in n}


def test_a_refit_carries_only_the_adapters(tiny_setup, tmp_path):
    from specroll.rl.replica import Weights

    t = make_trainer(tiny_setup, tmp_path / "run", "lora.rank=4", "lora.targets=[q_proj]")
    w = Weights.of(t.policy, None)
    assert set(w.policy) == set(lora.adapters(t.policy)) and w.policy
    sent = sum(x.numel() for x in w.policy.values())
    assert sent < 0.05 * sum(p.numel() for p in t.policy.parameters())


def test_a_frozen_draft_is_sent_once_and_kept(tiny_setup, tmp_path):
    """draft.online=false (a draft frozen at its start, what SGLang and vLLM run beside a
    LoRA target): the refits after the first carry the adapters alone, and the engine
    keeps drafting with the draft it started with."""
    over = ("lora.rank=4", "draft.online=false", "pipeline.steps=3")
    t = make_trainer(tiny_setup, tmp_path / "run", *over)
    net = t.rollout.engine.drafter.network
    start = {k: v.clone() for k, v in net.state_dict().items()}
    sent, update = [], t.rollout.update_weights

    def spy(version, weights):
        sent.append(weights.draft)
        update(version, weights)

    t.rollout.update_weights = spy
    rows = t.run()
    assert len(sent) == 3 and all(d is None for d in sent)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in start.items())
    adapters = sum(v.numel() * v.element_size() for v in lora.adapters(t.policy).values())
    assert [m["refit_bytes"] for m in rows if "reward" in m] == [adapters] * 3
    assert any(m.get("acceptance_length") for m in rows)


@pytest.mark.parametrize("serve", ["merged", "adapters"])
def test_a_lora_run_keeps_the_engine_on_the_learners_policy(tiny_setup, tmp_path, serve):
    """The engine's log-probs against the learner's recomputation at every step of a
    LoRA run (rollout.recompute check every step), in each serving mode."""
    overrides = ("lora.rank=8", f"lora.serve={serve}", "lora.lr=1e-2", "pipeline.steps=3")
    t = make_trainer(tiny_setup, tmp_path / "run", *overrides, "learner.check_every=1")
    metrics = t.run()
    checked = [m["logprob_mismatch_max"] for m in metrics if m.get("logprob_mismatch_max")]
    assert len(checked) == 3 and max(checked) < 1e-4, checked
    assert sum(abs(v) for v in lora.adapters(t.policy)["layers.0.lora.B.q_proj"].flatten()) > 0


def _steps(out) -> list[dict]:
    timing = ("time", "step_s", "gen_tok_s", "gen_busy_s", "exposed_gen_s")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in timing} for m in rows]


def test_checkpoints_hold_the_adapters_and_resume_exactly(home, tmp_path):
    """A LoRA run's checkpoint holds adapters, not the base; interrupted after step 2
    and resumed, every metric of every step equals the uninterrupted run's."""
    from specroll.model.untrusted import load_tensors

    sets = ["--set", "lora.rank=4", "--set", "lora.lr=1e-2", "--set", "pipeline.checkpoint_every=1"]
    assert train_tiny(tmp_path / "full", "--steps", "4", *sets) == 0
    state = load_tensors(tmp_path / "full" / "checkpoints" / "step-000004" / "state.pt")
    assert state["policy"] and all(".lora." in k for k in state["policy"])
    assert state["lora_spec"]["rank"] == 4
    assert train_tiny(tmp_path / "cut", "--steps", "2", *sets) == 0
    assert train_tiny(tmp_path / "cut", "--steps", "4", "--resume", *sets) == 0
    assert _steps(tmp_path / "cut") == _steps(tmp_path / "full")


@pytest.fixture
def lora_run(home, tmp_path):
    """A finished 2-step LoRA run of the tiny preset (adapters on q, v and down)."""
    out = tmp_path / "run"
    sets = ["lora.rank=4", "lora.lr=5e-2", "lora.targets=[q_proj,v_proj,down_proj]"]
    assert train_tiny(out, "--steps", "2", *[x for s in sets for x in ("--set", s)]) == 0
    return out


def _policy_logits(src, tokens):
    from specroll.rl.run import export_source

    policy, _, _ = export_source.load(export_source.resolve(src), adapters=True)
    assert policy.lora_spec is not None
    with torch.no_grad():
        return policy(tokens).logits


def test_exports_load_in_transformers_and_the_adapter_in_peft(lora_run, tmp_path):
    """The merged export is a transformers model and the --peft export a PEFT adapter on
    the transformers base; both give the checkpoint's logits to fp32 rounding."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from specroll.cli import main
    from specroll.model.hub import resolve

    tokens = torch.tensor([[1, 5, 9, 2, 7, 3]])
    want = _policy_logits(lora_run, tokens)
    assert main(["export", str(lora_run), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", str(lora_run), "--peft", "--out", str(tmp_path / "adapter")]) == 0
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(resolve("tiny"))
        plain = base(tokens).logits  # (peft adapts `base` in place)
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")(tokens).logits
    assert (merged - want).abs().max() < 1e-4
    assert (adapted - want).abs().max() < 1e-4
    assert (adapted - plain).abs().max() > 1e-3  # the adapter is applied


def test_a_run_starts_from_a_peft_adapter(lora_run, tmp_path):
    """lora.init: the run's adapters start as the given adapter's (its r, alpha and
    targets); its first validation equals the exported run's policy's."""
    from specroll.cli import main
    from specroll.model import load_model
    from specroll.model.hub import resolve
    from specroll.rl.config import build_config
    from specroll.rl.run.adapters import adapt

    assert main(["export", str(lora_run), "--peft", "--out", str(tmp_path / "a")]) == 0
    cfg = build_config("tiny", [f"lora.init={tmp_path / 'a'}"])
    policy = adapt(cfg, load_model(resolve("tiny")))
    assert policy.lora_spec.targets == ("q_proj", "v_proj", "down_proj")
    tokens = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert (policy(tokens).logits - _policy_logits(lora_run, tokens)).abs().max() < 1e-5
    assert train_tiny(tmp_path / "b", "--steps", "1", "--set", f"lora.init={tmp_path / 'a'}") == 0


def _foreign_adapter(tmp_path, **change) -> str:
    """A PEFT adapter directory of another model (or with the config edited)."""
    from specroll.model import ModelConfig, Transformer, peft_io

    shape = dict(hidden_size=48, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2)
    other = Transformer(ModelConfig(vocab_size=300, **shape))
    other.init_weights(0)
    lora.attach(other, lora.LoraSpec(4, 8.0, ("q_proj",)))
    d = peft_io.save(other, tmp_path / "foreign", "tiny-v1")
    if change:
        cfg = json.loads((d / peft_io.CONFIG).read_text()) | change
        (d / peft_io.CONFIG).write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize(
    "setting,words",
    [
        ("lora.targets=[q_proj,lm_head]", "unknown target 'lm_head'; allowed: q_proj"),
        ("lora.rank=-1", "lora.rank must be >= 0"),
        ("lora.rank=100000", "lora.rank must be <= 4096"),
        ("lora.rank=4000", "lora.rank=4000 is larger than q_proj of this model"),
        ("lora.serve=unmerged", "lora.serve must be one of ('merged', 'adapters')"),
        ("lora.targets=[q_proj]", "lora.targets is set but lora.rank=0 trains the whole policy"),
        ("lora.init=FOREIGN", "has shape [4, 48]; this policy needs [4, 64] (an adapter for"),
        ("lora.init=NAMED", "is an adapter for 'HuggingFaceTB/SmolLM2-135M'; this run's policy"),
        ("lora.init=MODULES", "adapts 'embed_tokens', which specroll does not adapt"),
    ],
)
def test_bad_lora_settings_fail_in_one_line_before_a_model_loads(
    home, tmp_path, capsys, monkeypatch, setting, words
):
    import specroll.model

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the setting was refused")

    monkeypatch.setattr(specroll.model, "load_model", refuse)
    edits = {
        "FOREIGN": {},
        "NAMED": {"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M"},
        "MODULES": {"target_modules": ["q_proj", "embed_tokens"]},
    }
    for key, change in edits.items():
        if key in setting:
            setting = setting.replace(key, _foreign_adapter(tmp_path, **change))
    assert train_tiny(tmp_path / "run", "--steps", "1", "--set", setting) == 2
    err = err_text(capsys)
    assert words in err, err


def test_the_kl_reference_of_fresh_adapters_is_the_base_without_a_copy(tiny_setup, tmp_path):
    """With KL on, a LoRA run whose adapters start at zero scores the reference with its
    adapters off instead of holding a copy of the policy: the same log-probs as a copy of
    the initial policy, before and after updates (the reference stays the base)."""
    from tests.conftest import step_batch

    t = make_trainer(tiny_setup, tmp_path / "run", "lora.rank=4", "loss.kl_coef=0.1")
    learner = t.host.learner
    assert learner.reference is None and learner.base_reference
    initial = copy.deepcopy(t.policy)
    batch = step_batch(t)
    for _ in range(2):
        policy_lp, ref_lp = t.host.logprobs(batch)
        assert torch.equal(ref_lp, learner.logprobs(batch, initial))
        m = t.host.train(batch, policy_lp, ref_lp, lr=5e-2)
    assert m["kl"] > 0  # the policy moved away from its reference
