"""`specroll export` and the exports a run writes: Hugging Face directories that
transformers loads as-is, with the checkpoint's exact weights (fp32), or those weights
rounded to bf16 (`--dtype bfloat16`), sharded with a correct index, the tokenizer, the
run's generation settings and the draft; bad sources and destinations refused clearly."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors import safe_open

from tests.conftest import err_text, fails_clearly, train_tiny


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny run with a checkpoint and an export after each step."""
    root = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECROLL_HOME", str(root / "home"))
        out = root / "run"
        args = ("--steps", "2", "--set", "pipeline.checkpoint_every=1")
        assert train_tiny(out, *args, "--set", "pipeline.export_every=1") == 0
        yield out


@pytest.fixture()
def home_of(run, monkeypatch):
    """The run's SPECROLL_HOME (where its tiny policy was built)."""
    monkeypatch.setenv("SPECROLL_HOME", str(run.parent / "home"))


def _export(*argv: str) -> int:
    from specroll.cli import main

    return main(["export", *map(str, argv)])


def _checkpoint_policy(ck):
    """The policy and draft tensors a checkpoint holds, in a Transformer."""
    from specroll.model import Transformer
    from specroll.model.hub import resolve
    from specroll.model.weights import load_state, read_config

    state = torch.load(ck / "state.pt", weights_only=True)
    policy = Transformer(read_config(resolve("tiny")))
    load_state(policy, state["policy"], "test")
    return policy.eval(), state["draft"]


IDS = torch.tensor([[5, 17, 40, 41, 9, 33, 12, 70, 3, 8, 2, 60]])


def _hf_logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path)).eval().float()
    with torch.no_grad():
        return model(IDS).logits


def test_export_loads_in_transformers_with_the_checkpoints_logits(run, home_of, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from specroll.drafting.trainable import load_draft

    out = tmp_path / "hf"
    assert _export(run, "--out", out, "--max-shard-size", "40KB") == 0
    policy, draft_state = _checkpoint_policy(run / "checkpoints" / "step-000002")
    with torch.no_grad():
        ours = policy(IDS).logits
    torch.testing.assert_close(_hf_logits(out), ours, atol=1e-5, rtol=1e-5)
    # the index names every tensor once, in the file that holds it, and the sizes add up
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert not (out / "model.safetensors").exists()
    total, seen = 0, set()
    for name in shards:
        with safe_open(out / name, "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert index["weight_map"][k] == name and k not in seen
                seen.add(k)
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
        assert (out / name).stat().st_size <= 40_000 + 2_000 or len(f.keys()) == 1
    assert seen == set(index["weight_map"]) and index["metadata"]["total_size"] == total
    # tokenizer, generation settings of the run, and the draft in its serving layout
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok.encode("What is 2 + 3?")) == "What is 2 + 3?"
    gen = GenerationConfig.from_pretrained(str(out))
    assert (gen.temperature, gen.max_new_tokens, gen.do_sample) == (1.0, 24, True)
    assert gen.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    draft = load_draft(out / "draft", policy)
    for k, v in draft.state_dict().items():
        assert torch.equal(v, draft_state[k]), k


def test_bfloat16_export_is_the_checkpoint_rounded_to_bf16(run, home_of, tmp_path):
    from specroll.model import load_model

    ck = run / "checkpoints" / "step-000001"
    out = tmp_path / "bf16"
    assert _export(ck, "--out", out, "--dtype", "bfloat16") == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    policy, _ = _checkpoint_policy(ck)
    rounded, _ = _checkpoint_policy(ck)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        want, exact = rounded(IDS).logits, policy(IDS).logits
    loaded = load_model(out)  # specroll reads it back (upcast to fp32)
    for (name, a), b in zip(
        loaded.state_dict().items(), rounded.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    torch.testing.assert_close(_hf_logits(out), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, exact, atol=1e-6, rtol=0)  # the rounding is visible


def test_exports_every_step_hold_that_steps_weights(run, home_of, tmp_path):
    from specroll.model import load_model

    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step-000001", "step-000002"]
    for step in (1, 2):
        exp = run / "exports" / f"step-{step:06d}"
        assert (exp / "generation_config.json").is_file() and (exp / "draft").is_dir()
        policy, _ = _checkpoint_policy(run / "checkpoints" / f"step-{step:06d}")
        for (name, a), b in zip(
            load_model(exp).state_dict().items(), policy.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), (step, name)
    # the final policy/ gains the generation settings; the draft stays beside it
    assert (run / "policy" / "generation_config.json").is_file()
    assert (run / "draft" / "model.safetensors").is_file()


def test_a_run_without_checkpoints_exports_its_final_policy(run, home_of, tmp_path, capsys):
    from specroll.model import load_model

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("exports"))
    # damaged: the newest is skipped (said so), the older one exported
    state = copy / "checkpoints" / "step-000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    assert _export(copy, "--out", tmp_path / "a") == 0
    err = err_text(capsys)
    assert "skipped the damaged checkpoint step-000002" in err and "step-000001" in err
    shutil.rmtree(copy / "checkpoints")
    assert _export(copy, "--out", tmp_path / "b") == 0
    assert "final policy" in err_text(capsys)
    final = load_model(copy / "policy")
    torch.testing.assert_close(_hf_logits(tmp_path / "b"), final(IDS).logits, atol=1e-5, rtol=0)


def test_bad_sources_and_destinations_fail_clearly(run, home_of, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(run / "checkpoints" / "step-000001", ck)
    out = tmp_path / "out"
    fails_clearly(capsys, ["export", str(tmp_path / "nope"), "--out", str(out)], "does not exist")
    fails_clearly(capsys, ["export", str(run.parent), "--out", str(out)], "neither a run directory")
    fails_clearly(capsys, ["export", str(ck), "--out", str(out), "--max-shard-size", "lots"], "2GB")
    (ck / "state.pt").write_bytes(b"\0" * 10)
    fails_clearly(capsys, ["export", str(ck), "--out", str(out)], "damaged checkpoint", "state.pt")
    assert not out.exists()  # refused before anything was written
    # an existing destination: refused, replaced with --overwrite, never foreign files
    good = str(run / "checkpoints" / "step-000001")
    assert _export(good, "--out", out) == 0
    fails_clearly(capsys, ["export", good, "--out", str(out)], "exists", "--overwrite")
    assert _export(good, "--out", out, "--overwrite") == 0
    (out / "notes.txt").write_text("mine")
    fails_clearly(capsys, ["export", good, "--out", str(out), "--overwrite"], "notes.txt")
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_drafts_architecture_rebuilds_from_what_a_checkpoint_keeps(tiny_setup, tmp_path, kind):
    """`draft_config` survives a weights-only checkpoint load, and `new_draft` builds from
    it a network whose tensors have the draft's names and shapes (what `specroll export`
    fills from a checkpoint)."""
    from specroll.drafting.trainable import draft_config, new_draft, save_draft
    from specroll.model.weights import load_state
    from specroll.rl.config import build_config
    from specroll.rl.run.draft import build_draft

    policy, tok = tiny_setup
    draft = build_draft(build_config("tiny", [f"rollout.drafter={kind}"]), policy, tok, tmp_path)
    torch.save({"draft_config": {"kind": kind, "config": draft_config(draft)}}, tmp_path / "s")
    spec = torch.load(tmp_path / "s", weights_only=True)["draft_config"]
    twin = new_draft(spec["kind"], spec["config"], policy)
    load_state(twin, draft.state_dict(), "the twin")  # raises on any name or shape
    save_draft(twin, tmp_path / "a")
    save_draft(draft, tmp_path / "b")
    assert (tmp_path / "a" / "config.json").read_text() == (
        tmp_path / "b" / "config.json"
    ).read_text()


def test_a_sharded_learners_checkpoint_exports_from_its_dcp_state(run, home_of, tmp_path):
    """A checkpoint whose weights are in `learner/` (DCP, as `learner.strategy: fsdp`
    writes it) exports the same weights as the state.pt it was made from."""
    from specroll.drafting.trainable import load_draft, new_draft
    from specroll.model import load_model
    from specroll.model.weights import load_state
    from specroll.rl.learner.fsdp import dcp
    from specroll.rl.run import checkpoint
    from tests.conftest import learner

    ck = run / "checkpoints" / "step-000001"
    policy, draft_state = _checkpoint_policy(ck)
    state = torch.load(ck / "state.pt", weights_only=True)
    spec = state["draft_config"]
    draft = new_draft(spec["kind"], spec["config"], policy)
    load_state(draft, draft_state, "test")
    lr = learner(policy, draft=draft)
    sharded = {k: v for k, v in state.items() if k not in ("policy", "draft", "rng", "step")}
    sharded = {k: v for k, v in sharded.items() if not k.endswith("_opt")}
    with warnings.catch_warnings():  # one process without a group: meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        path = checkpoint.save(
            tmp_path / "checkpoints", 1, sharded, write=lambda d: dcp.save(lr, draft, d / "learner")
        )
    assert "policy" not in torch.load(path / "state.pt", weights_only=True)
    assert _export(path, "--out", tmp_path / "hf") == 0
    for (name, a), b in zip(
        load_model(tmp_path / "hf").state_dict().items(), state["policy"].values(), strict=True
    ):
        assert torch.equal(a, b), name
    exported = load_draft(tmp_path / "hf" / "draft", policy)
    for k, v in exported.state_dict().items():
        assert torch.equal(v, draft_state[k]), k
