"""Models, drafts and adapters from elsewhere (issue 58): every size a config.json implies
is bounded before a tensor is made, every file is a regular one before it is opened,
non-finite values are refused naming the file and the field, and what specroll writes
for others to read is readable by them."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specroll.cli import main
from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head
from specroll.drafting.eagle3_io import load_eagle3, save_eagle3
from specroll.model.config import SIZE_LIMITS, ModelConfig
from specroll.model.hub import resolve
from specroll.model.ops import ROPE_CHUNK, Rotary
from specroll.model.weights import load_model
from tests.conftest import fails_clearly

FIFO_WAIT_S = 20
"""A reader that waits on a FIFO is released (by a writer that closes) after this long:
the tests fail on the time taken, never hang."""


@pytest.fixture()
def model_dir(home, tmp_path) -> Path:
    """A copy of the tiny policy's directory, to be damaged."""
    d = tmp_path / "model"
    shutil.copytree(resolve("tiny"), d)
    return d


@pytest.fixture()
def draft_dir(model_dir, tmp_path) -> Path:
    """An EAGLE-3 draft of the tiny policy, saved as a draft from elsewhere would be."""
    policy = load_model(model_dir)
    head = Eagle3Head(Eagle3Config.for_target(policy.cfg), policy)
    head.init_weights(0, std=0.05)
    d = tmp_path / "draft"
    save_eagle3(head, d)
    return d


def _edit(config: Path, **fields) -> None:
    raw = json.loads(config.read_text())
    raw.update(fields)
    config.write_text(json.dumps(raw))


# ---------------------------------------------------------------- sizes a config implies


def test_a_context_window_of_300m_positions_is_refused_in_one_line_for_model_and_draft(
    model_dir, draft_dir, capsys
):
    _edit(model_dir / "config.json", max_position_embeddings=300_000_000)
    fails_clearly(
        capsys,
        ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "2"],
        str(model_dir / "config.json"),
        "max_position_embeddings=300000000",
        str(SIZE_LIMITS["max_position_embeddings"]),
    )
    _edit(draft_dir / "config.json", max_position_embeddings=10**10)
    policy = load_model(resolve("tiny"))
    with pytest.raises(ValueError, match=r"draft/config.json: max_position_embeddings=1000"):
        load_eagle3(draft_dir, policy.cfg, policy)


@pytest.mark.parametrize(
    "field,value",
    [
        ("vocab_size", 1 << 30),
        ("hidden_size", 1 << 20),
        ("intermediate_size", 1 << 30),
        ("num_hidden_layers", 10**6),
        ("num_attention_heads", 1 << 20),
        ("num_key_value_heads", 1 << 20),
        ("head_dim", 1 << 20),
        ("head_dim", 0),
        ("max_position_embeddings", 1e10),
        ("num_hidden_layers", -2),
        ("rms_norm_eps", -1),
        ("rms_norm_eps", float("nan")),
        ("rope_parameters", {"rope_type": "default", "rope_theta": float("inf")}),
    ],
)
def test_every_size_and_constant_of_a_config_is_checked_naming_file_and_field(
    draft_dir, field, value
):
    _edit(draft_dir / "config.json", **{field: value})
    policy = load_model(resolve("tiny"))
    with pytest.raises(ValueError) as e:
        load_eagle3(draft_dir, policy.cfg, policy)
    named = "rope_theta" if field == "rope_parameters" else field
    assert str(draft_dir / "config.json") in str(e.value) and named in str(e.value)
    assert "\n" not in str(e.value)


def test_the_rope_tables_hold_what_forwards_reach_not_what_the_file_says(model_dir):
    """A 16M-position window (within the limits) allocates one block; a forward further
    out grows the tables by blocks, each position's value independent of the growth."""
    _edit(model_dir / "config.json", max_position_embeddings=1 << 24)
    model = load_model(model_dir)
    assert model.rotary.cos.shape[0] == ROPE_CHUNK
    out = model(torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(out.logits).all() and model.rotary.cos.shape[0] == ROPE_CHUNK
    far = Rotary(model.cfg)
    pos = torch.tensor([[5, 3 * ROPE_CHUNK + 7]])
    cos, sin = far(pos, 3 * ROPE_CHUNK + 8)
    assert far.cos.shape[0] == 4 * ROPE_CHUNK
    near = Rotary(model.cfg)  # grown one block at a time
    for b in range(1, 5):
        near.cover(b * ROPE_CHUNK)
    assert torch.equal(near.cos, far.cos) and torch.equal(near.sin, far.sin)
    # the values are RoPE's: cos(pos * theta^(-2i/d))
    d = model.cfg.head_dim
    inv = 1.0 / (model.cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    want = torch.cos(torch.tensor(float(3 * ROPE_CHUNK + 7)) * inv)
    torch.testing.assert_close(cos[0, 1, 0, : d // 2], want, rtol=0, atol=2e-6)


def test_a_window_that_is_not_a_whole_number_of_blocks_is_covered_to_its_end():
    cfg = ModelConfig(max_position_embeddings=ROPE_CHUNK + 5)
    rot = Rotary(cfg)
    rot.cover(10**9)
    assert rot.cos.shape[0] == ROPE_CHUNK + 5


# ------------------------------------------------------------------ FIFOs, not files


def _fifo_in_place_of(path: Path) -> threading.Event:
    """Replace `path` by a FIFO; a thread gives any reader waiting on it an end of file
    after FIFO_WAIT_S (so a failing test ends). Set the returned event when done."""
    path.unlink()
    os.mkfifo(path)
    done = threading.Event()

    def unblock() -> None:
        if not done.wait(FIFO_WAIT_S):
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=unblock, daemon=True).start()
    return done


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_fifo_in_a_model_directory_is_refused_at_once(model_dir, capsys, name):
    done = _fifo_in_place_of(model_dir / name)
    start = time.monotonic()
    try:
        last = fails_clearly(
            capsys, ["generate", "--model", str(model_dir), "--prompt", "hi"], "not a regular file"
        )
    finally:
        done.set()
    assert time.monotonic() - start < FIFO_WAIT_S / 2
    assert str(model_dir / name) in last and "FIFO" in last


def test_a_fifo_in_a_draft_directory_is_refused_at_once(model_dir, draft_dir, capsys):
    done = _fifo_in_place_of(draft_dir / "model.safetensors")
    start = time.monotonic()
    try:
        fails_clearly(
            capsys,
            ["generate", "--model", str(model_dir), "--prompt", "hi", "--drafter",
             f"eagle3:{draft_dir}"],
            str(draft_dir / "model.safetensors"),
            "not a regular file",
        )  # fmt: skip
    finally:
        done.set()
    assert time.monotonic() - start < FIFO_WAIT_S / 2


# --------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_in_a_draft_or_a_model_are_refused_naming_file_and_tensor(
    model_dir, draft_dir, bad
):
    policy = load_model(model_dir)
    f = draft_dir / "model.safetensors"
    tensors = load_file(f)
    tensors["fc.weight"][0, 0] = bad
    save_file(tensors, f)
    with pytest.raises(ValueError, match=rf"{f}: tensor 'fc.weight' holds 1 non-finite"):
        load_eagle3(draft_dir, policy.cfg, policy)
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    tensors["model.norm.weight"][3] = bad
    save_file(tensors, f)
    with pytest.raises(ValueError, match=rf"{f}: tensor 'model.norm.weight' holds 1"):
        load_model(model_dir)


def _adapter(tmp_path: Path, **config) -> Path:
    """A PEFT adapter of rank 2 on q_proj of the tiny policy."""
    cfg = load_model(resolve("tiny")).cfg
    d = tmp_path / "adapter"
    d.mkdir()
    raw = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (d / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    H, q = cfg.hidden_size, cfg.q_size
    pre = "base_model.model.model.layers"
    t = {}
    for i in range(cfg.num_layers):
        t[f"{pre}.{i}.self_attn.q_proj.lora_A.weight"] = torch.full((2, H), 0.01)
        t[f"{pre}.{i}.self_attn.q_proj.lora_B.weight"] = torch.zeros(q, 2)
    save_file(t, d / "adapter_model.safetensors")
    return d


@pytest.mark.parametrize(
    "text,needle",
    [
        ('"lora_alpha": NaN', "lora_alpha must be a number in (0, 65536.0], got nan"),
        ('"lora_alpha": Infinity', "got inf"),
        ('"lora_alpha": 1e300', "got 1e+300"),
        ('"lora_alpha": 1' + "0" * 400, "(401 characters)"),
        ('"target_modules": [["q_proj"]]', "target_modules must be a list of projection"),
    ],
)
def test_an_adapter_config_from_elsewhere_is_checked_field_by_field(
    home, tmp_path, capsys, text, needle
):
    d = _adapter(tmp_path)
    raw = (d / "adapter_config.json").read_text()
    key = text.split(":")[0]
    start = raw.index(key)
    end = raw.index(",", start) if raw.find(",", start) > 0 else raw.index("}", start)
    (d / "adapter_config.json").write_text(raw[:start] + text + raw[end:])
    last = fails_clearly(
        capsys,
        ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--steps", "1",
         "--set", f"lora.init={d}"],
        str(d / "adapter_config.json"),
        needle,
    )  # fmt: skip
    assert len(last) < 400


def test_non_finite_adapter_weights_and_alphas_are_refused_before_step_one(home, tmp_path, capsys):
    d = _adapter(tmp_path)
    f = d / "adapter_model.safetensors"
    t = load_file(f)
    next(iter(t.values()))[0, 0] = float("nan")
    save_file(t, f)
    run = ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--steps", "1"]
    fails_clearly(capsys, [*run, "--set", f"lora.init={d}"], str(f), "non-finite")
    fails_clearly(capsys, [*run, "--set", "lora.rank=2", "--set", "lora.alpha=1e308"], "lora.alpha")
    fails_clearly(capsys, [*run, "--set", "lora.rank=2", "--set", "lora.alpha=nan"], "lora.alpha")


# ------------------------------------------------------- files others are to read


def test_exported_files_take_the_umask_not_a_private_mode(home, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        run = tmp_path / "run"
        assert main(["train", "--preset", "tiny", "--out", str(run), "--steps", "1"]) == 0
        out = tmp_path / "export"
        assert main(["export", str(run), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    written = [*out.iterdir(), *(run / "policy").iterdir(), *(run / "draft").iterdir()]
    names = {p.name for p in written}
    assert {"model.safetensors", "config.json", "generation_config.json"} <= names
    for p in written:
        if p.is_file():
            assert stat.S_IMODE(p.stat().st_mode) == 0o644, p


def test_a_nan_rope_factor_is_refused():
    with pytest.raises(ValueError, match="rope_scaling.factor"):
        ModelConfig(rope_scaling={"rope_type": "linear", "factor": math.nan})
