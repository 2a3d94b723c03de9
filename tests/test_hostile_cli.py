"""Hostile use of the commands other than `train` (issue 30): every bad input ends in one
`error:` line naming the flag or file and what is allowed, outputs are checked before any
model loads, and the statistics a command prints are true."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specroll.cli import main
from tests.conftest import fails_clearly

TINY = ["--model", "tiny"]
FEW = ["--prompt", "hi", "--max-new-tokens", "4"]


@pytest.fixture
def home(tmp_path_factory, monkeypatch) -> Path:
    """One SPECROLL_HOME for this module, so the tiny model is built once."""
    home = tmp_path_factory.getbasetemp() / "hostile-home"
    monkeypatch.setenv("SPECROLL_HOME", str(home))
    return home


def _no_model(monkeypatch) -> None:
    """Any model load fails the test: the check under test must come first."""
    from specroll.cli import common

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(common, "load_policy", refuse)


# ------------------------------------------------ 1. outputs checked before the work


def test_unwritable_outputs_fail_before_any_model_loads(capsys, tmp_path, home, monkeypatch):
    a_dir, a_file = tmp_path / "adir", tmp_path / "afile"
    a_dir.mkdir()
    a_file.write_text("x")
    under_file = str(a_file / "x")
    _no_model(monkeypatch)
    fails_clearly(capsys, ["generate", *TINY, *FEW, "--out", str(a_dir)], "--out", "is a directory")
    fails_clearly(
        capsys, ["generate", *TINY, *FEW, "--out", under_file], "--out", "not a directory"
    )
    fails_clearly(capsys, ["draft", "data", "--policy", "tiny", "--out", str(a_file)], "--out")
    fails_clearly(capsys, ["draft", "data", "--policy", "tiny", "--out", under_file], "--out")
    fails_clearly(capsys, ["bench", "profile", *TINY, "--out", str(a_dir)], "--out")
    fails_clearly(
        capsys, ["simulate", "--no-sweep", "--plots", str(a_file)], "--plots", "is a file"
    )


@pytest.fixture
def data_dir(tmp_path_factory, home) -> Path:
    """A tiny `draft data` directory (4 rollouts of 6 tokens)."""
    d = tmp_path_factory.getbasetemp() / "hostile-data"
    if not (d / "meta.json").is_file():
        argv = ["draft", "data", "--policy", "tiny", "--n", "4", "--shard-size", "4"]
        assert main([*argv, "--max-new-tokens", "6", "--out", str(d)]) == 0
    return d


def test_draft_train_out_checked_before_loading(capsys, tmp_path, data_dir, monkeypatch):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    _no_model(monkeypatch)
    base = ["draft", "train", "--data", str(data_dir)]
    fails_clearly(capsys, [*base, "--out", str(a_file)], "--out", "is a file")
    fails_clearly(capsys, [*base, "--out", str(a_file / "d")], "--out", "not a directory")


# ------------------------------------------------ 2. an existing draft is not replaced


def _holds_lock(directory: Path) -> subprocess.Popen:
    """A child process that holds `directory`'s DirLock until killed."""
    code = (
        "import sys, time; from specroll.outputs import DirLock; "
        f"DirLock({str(directory)!r}).acquire(); print('held', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_draft_train_refuses_an_existing_draft_without_overwrite(capsys, tmp_path, data_dir):
    out = tmp_path / "draft"
    out.mkdir()
    (out / "config.json").write_text('{"keep": "me"}')
    base = ["draft", "train", "--data", str(data_dir), "--out", str(out)]
    fast = ["--epochs", "1", "--ttt-steps", "1", "--draft-vocab-size", "32"]
    fails_clearly(capsys, [*base, *fast], "--out", "config.json", "--overwrite")
    assert json.loads((out / "config.json").read_text()) == {"keep": "me"}
    child = _holds_lock(out)
    try:
        fails_clearly(capsys, [*base, *fast, "--overwrite"], "--out", "in use", f"pid {child.pid}")
    finally:
        child.kill()
        child.wait()
    assert main([*base, *fast, "--overwrite"]) == 0
    assert "keep" not in json.loads((out / "config.json").read_text())
    assert (out / "model.safetensors").is_file()
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporaries


# ------------------------------------------------ 3. damaged drafts name the file


@pytest.fixture
def drafts(tmp_path, home) -> tuple[object, Path, Path]:
    """(tiny policy, an EAGLE-3 draft dir, an MTP draft dir), freshly saved."""
    import torch

    from specroll.drafting.data import default_aux_layers
    from specroll.drafting.train import new_eagle3, new_mtp
    from specroll.drafting.trainable import save_draft
    from specroll.model import load_model
    from specroll.model.hub import resolve

    policy = load_model(resolve("tiny"))
    vocab = torch.arange(min(32, policy.cfg.vocab_size))
    save_draft(new_eagle3(policy, vocab, default_aux_layers(policy), 0), tmp_path / "e3")
    save_draft(new_mtp(policy, 0), tmp_path / "mtp")
    return policy, tmp_path / "e3", tmp_path / "mtp"


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@pytest.mark.parametrize("damage", ["truncated", "list-config"])
def test_damaged_draft_dirs_name_the_file(capsys, drafts, kind, damage):
    from specroll.drafting.trainable import load_draft

    policy, e3, mtp = drafts
    d = e3 if kind == "eagle3" else mtp
    if damage == "truncated":
        f = d / ("model.safetensors" if kind == "eagle3" else "mtp.safetensors")
        f.write_bytes(f.read_bytes()[:100])
    else:
        f = d / "config.json"
        f.write_text("[1, 2]")
    argv = ["generate", *TINY, *FEW, "--drafter", f"{kind}:{d}"]
    fails_clearly(capsys, argv, str(f))
    with pytest.raises(ValueError, match=str(f)):  # the train config's draft.init
        load_draft(d, policy)


def test_draft_train_init_names_a_damaged_draft(capsys, tmp_path, data_dir, drafts):
    _, e3, _ = drafts
    (e3 / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    argv = ["draft", "train", "--data", str(data_dir), "--out", str(tmp_path / "o")]
    fails_clearly(capsys, [*argv, "--init", str(e3)], str(e3 / "model.safetensors"))


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--k", "-1"], ["--k", "[0, 32]"]),
        (["--k", "1000000"], ["--k", "[0, 32]"]),
        (["--max-seq", "0"], ["--max-seqs", ">= 1"]),
        (["--tp", "0"], ["--tp", ">= 1"]),
        (["--alphas", "0.5,x"], ["--alphas"]),
        (["--draft-params", "nan"], ["--draft-params"]),
    ],
)
def test_simulate_flags_name_the_allowed_range(capsys, flags, needles):
    fails_clearly(capsys, ["simulate", "--no-sweep", "--json", *flags], *needles)


def test_simulate_model_json_without_keys(capsys, tmp_path):
    cfg = tmp_path / "m.json"
    cfg.write_text('{"hidden_size": 8}')
    fails_clearly(capsys, ["simulate", "--model", str(cfg)], str(cfg), "num_attention_heads")
    cfg.write_text("[1]")
    fails_clearly(capsys, ["simulate", "--model", str(cfg)], str(cfg), "not a JSON object")


def test_bench_spec_refuses_zero_repeats(capsys, monkeypatch):
    _no_model(monkeypatch)
    fails_clearly(capsys, ["bench", "spec", *TINY, "--repeats", "0"], "--repeats", ">= 1")


def test_unreachable_ray_address_fails_fast_and_says_so():
    from specroll.rl.cluster import connect
    from specroll.rl.config import build_config

    cfg = build_config("tiny", ["ray.address=127.0.0.1:1", "rollout.backend=ray"])
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"127\.0\.0\.1:1.*unreachable.*waited"):
        connect(cfg)
    assert time.monotonic() - t0 < 10


# ------------------------------------------------ 4. inputs that were ignored


def test_generate_bad_inputs_name_the_flag_or_file(capsys, tmp_path, home, monkeypatch):
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    fails_clearly(capsys, ["generate", "--model", str(gguf), *FEW], str(gguf), "GGUF")
    _no_model(monkeypatch)
    fails_clearly(capsys, ["generate", *TINY, *FEW, "--samples", "0"], "--samples", ">= 1")
    fails_clearly(capsys, ["generate", *TINY, "--prompts", str(binary)], str(binary), "text file")
    fails_clearly(
        capsys, ["generate", *TINY, "--prompts", str(tmp_path)], str(tmp_path), "directory"
    )


# ------------------------------------------------ 5. small untruths


def test_draft_sampling_progress_shows_at_once(tmp_path, home):
    """The sampling stage reports its total before the first shard, then per rollout."""
    from specroll.drafting.data import DraftDataConfig, collect, prompt_ids
    from specroll.model import load_model
    from specroll.model.hub import resolve
    from specroll.model.tokenizer import Tokenizer

    d = resolve("tiny")
    cfg = DraftDataConfig(n=3, max_new_tokens=4, shard_size=3)
    calls: list[tuple[int, int, bool]] = []
    out = tmp_path / "data"

    def progress(done: int, total: int) -> None:
        calls.append((done, total, (out / "shard-00000.safetensors").exists()))

    policy = load_model(d)
    collect(policy, prompt_ids(Tokenizer(d), cfg), "tiny", cfg, out, progress=progress)
    assert calls[0] == (0, 3, False)  # the total, before any shard is written
    assert any(done == 3 and not written for done, _, written in calls)  # per rollout
