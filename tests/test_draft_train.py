"""Drafter training: the TTT unroll reproduces inference, training improves acceptance,
runs are reproducible and resumable, bad inputs fail before any work."""

from __future__ import annotations

import json

import pytest
import torch

from specroll.drafters.eagle3 import Eagle3Drafter
from specroll.drafting.data import DraftData, DraftDataConfig, collect
from specroll.drafting.eagle3_io import load_eagle3
from specroll.drafting.mtp_heads import MTPConfig, MTPDraft
from specroll.drafting.train import (
    DraftTrainConfig,
    new_eagle3,
    select_vocab,
    train_draft,
)
from specroll.drafting.trainable import TrainableDraft, load_draft, save_draft
from specroll.drafting.ttt import ttt_unroll, unroll_mask
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.model import ModelConfig, Transformer

TARGET = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(TARGET).init_weights(seed=0, std=0.1).eval()


def _perturb(net: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * (0.1 if "norm" in name else 0.05))


def test_unroll_mask_is_causal_plus_diagonal():
    m = unroll_mask(4, 2, start=1)  # anchors 1..3; keys: 4 step-0, 3 step-1, 3 step-2
    assert m.shape == (3, 10)
    assert m[:, :4].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert torch.equal(m[:, 4:7], torch.eye(3, dtype=torch.bool))
    assert torch.equal(m[:, 7:], torch.eye(3, dtype=torch.bool))


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@pytest.mark.parametrize("start", [0, 5])
def test_unroll_equals_incremental_drafting(target, kind, start):
    """Step j at anchor t of the training unroll computes exactly what the engine's drafter
    computes at depth j after pairs 0..t were fed from the target (cache + recursion)."""
    g = torch.Generator().manual_seed(1)
    T, steps = 14, 4
    x = torch.randint(0, 97, (2, T), generator=g)
    if kind == "eagle3":
        vocab = torch.randperm(97, generator=g)[:60].sort().values
        net = new_eagle3(target, vocab, (2, 2, 1), seed=3)
    else:
        net = MTPDraft(MTPConfig.for_target(TARGET, 1), target).init_weights(3, 0.1)
    _perturb(net, 4)
    net.for_training()
    assert isinstance(net, TrainableDraft) and net.kind == kind
    with torch.no_grad():
        out = target(x, hidden_layers=(2, 1, 4))
        H = 64
        final = torch.nn.functional.rms_norm(out.hidden[4], (H,), target.norm, TARGET.rms_norm_eps)
        aux = torch.cat([out.hidden[2], out.hidden[2], out.hidden[1]], dim=-1)
        feats = net.features(aux, final)
        states = ttt_unroll(net.step, feats, x, steps, group=net.kv_group, start=start)
        cache = net.new_cache(2, 32)
        run = (
            (lambda *a, **k: net(*a, **k))
            if kind == "eagle3"
            else (lambda *a, **k: net(0, *a, **k))
        )
        checked = 0
        for t in range(start, T - steps - 1):
            # pairs 0..t from the target: tokens x_1..x_{t+1}, features f_0..f_t
            _, st = run(x[:, 1 : t + 2], feats[:, : t + 1], torch.zeros(2, dtype=torch.long), cache)
            h = st[:, -1:]
            assert (h[:, 0] - states[0][:, t]).abs().max() <= 1e-5
            for j in range(1, steps):
                lg, h = run(x[:, t + 1 + j : t + 2 + j], h, torch.full((2,), t + j), cache)
                want = net.readout(states[j][:, t - (start if j else 0)])
                assert (lg[:, 0] - want).abs().max() <= 1e-5, (t, j)
                checked += 1
        assert checked >= 3 * (steps - 1)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_save_draft_round_trips_through_load_draft(target, kind, tmp_path):
    """`save_draft` writes each kind in its serving layout and `load_draft` reads back the
    same weights (bit for bit) and the same kind."""
    if kind == "eagle3":
        vocab = torch.arange(0, 97, 2)
        net = new_eagle3(target, vocab, (2, 2, 1), seed=3)
    else:
        net = MTPDraft(MTPConfig.for_target(TARGET, 2), target).init_weights(3, 0.1)
    _perturb(net, 5)
    save_draft(net, tmp_path / "d")
    back = load_draft(tmp_path / "d", target)
    assert back.kind == kind and type(back) is type(net)
    mine, theirs = net.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_select_vocab_most_frequent_ascending():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert select_vocab(counts, 3).tolist() == [2, 3, 5]
    assert select_vocab(counts, 4).tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_vocab(counts, 7)


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory):
    """Rollouts of the tiny policy at T=1 (sharpened so that there is something to learn)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (6,), generator=g).tolist() for _ in range(48)]
    cfg = DraftDataConfig(prompts="test", n=48, max_new_tokens=40, shard_size=16, seed=1)
    d = tmp_path_factory.mktemp("data")
    collect(target, prompts, "tiny", cfg, d)
    return d, prompts, cfg


def test_collect_resumes_and_refuses_other_settings(target, data_dir, tmp_path):
    d, prompts, cfg = data_dir
    data = DraftData(d)
    assert len(data.sequences) == 48 and data.num_tokens() > 48 * 6
    s = data.sequences[0]
    assert s.aux.shape == (len(s.tokens), 3 * 64) and s.aux.dtype == torch.float16
    # an interrupted run (one shard missing) resumes to identical data
    (d / "shard-00001.safetensors").rename(tmp_path / "saved")
    collect(target, prompts, "tiny", cfg, d)
    again = DraftData(d)
    for a, b in zip(data.sequences, again.sequences, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.aux, b.aux)
    with pytest.raises(ValueError, match="other settings"):
        collect(target, prompts, "tiny", DraftDataConfig(prompts="test", n=48, seed=2), d)


def test_training_is_reproducible_resumable_and_improves_acceptance(target, data_dir, tmp_path):
    d, prompts, _ = data_dir
    data = DraftData(d)
    cfg = DraftTrainConfig(
        draft_vocab_size=97,
        ttt_steps=3,
        epochs=3,
        batch_tokens=512,
        lr=3e-3,
        eval_frac=0.0,
        checkpoint_every=4,
    )
    logs: list[dict] = []
    train_draft(target, data, cfg, tmp_path / "a", log=logs.append)
    first, last = logs[0]["accept"], logs[-1]["accept"]
    assert last[0] > first[0] + 0.05, (first, last)
    ref = load_eagle3(tmp_path / "a", TARGET, target)

    class Stop(Exception):
        pass

    def interrupt(r):
        if r["step"] == 6:
            raise Stop

    with pytest.raises(Stop):
        train_draft(target, data, cfg, tmp_path / "b", log=interrupt)
    assert (
        json.loads(
            json.dumps(torch.load(tmp_path / "b" / "trainer.pt", weights_only=False)["step"])
        )
        == 4
    )
    train_draft(target, data, cfg, tmp_path / "b", resume=True)
    again = load_eagle3(tmp_path / "b", TARGET, target)
    for (n, a), (_, b) in zip(ref.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    # the trained head drafts in the engine, and accepts more than a fresh one
    reqs = [
        Request(p, SamplingParams(1.0, max_new_tokens=30, seed=i))
        for i, p in enumerate(prompts[:8])
    ]
    rates = []
    for head in (new_eagle3(target, torch.arange(97), (2, 2, 1), 0), ref):
        eng = Engine(target, EngineConfig(max_batch=4), Eagle3Drafter(head), FixedDepth(3))
        eng.generate(reqs)
        rates.append(eng.stats.acceptance_length)
    assert rates[1] > rates[0] + 0.1, rates


def test_bad_inputs_fail_before_work(target, data_dir, tmp_path):
    d, _, _ = data_dir
    with pytest.raises(ValueError, match="no meta.json"):
        DraftData(tmp_path / "missing")
    other = Transformer(ModelConfig(**{**TARGET.__dict__, "vocab_size": 101})).init_weights()
    with pytest.raises(ValueError, match="vocab_size=97, the policy has 101"):
        train_draft(other, DraftData(d), DraftTrainConfig(), tmp_path / "x")
    wide = Transformer(
        ModelConfig(**{**TARGET.__dict__, "hidden_size": 128, "head_dim": 16})
    ).init_weights()
    with pytest.raises(ValueError, match="hidden_size"):
        train_draft(wide, DraftData(d), DraftTrainConfig(), tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="kind must be one of"):
        DraftTrainConfig(kind="medusa")


def test_mtp_head_trains_and_loads(target, data_dir, tmp_path):
    from specroll.drafting.mtp_io import load_mtp

    d, _, _ = data_dir
    cfg = DraftTrainConfig(
        kind="mtp", ttt_steps=2, epochs=2, batch_tokens=512, lr=3e-3, eval_frac=0.1
    )
    logs: list[dict] = []
    out = train_draft(target, DraftData(d), cfg, tmp_path / "m", log=logs.append)
    assert logs[-1]["accept"][0] > logs[0]["accept"][0]
    held = json.loads((out / "train_summary.json").read_text())["held_out"]
    assert len(held["accept"]) == 2 and all(0 <= a <= 1 for a in held["accept"])
    assert load_mtp(out, target).num_heads == 1
    # fine-tuning starts from the trained heads, not from scratch
    tuned: list[dict] = []
    ft = DraftTrainConfig(**{**cfg.__dict__, "epochs": 1, "init": str(out)})
    train_draft(target, DraftData(d), ft, tmp_path / "m2", log=tuned.append)
    assert tuned[0]["accept"][0] > logs[0]["accept"][0] + 0.02
