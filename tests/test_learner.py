"""The learner's numerics and placement: truncated importance sampling against hand-computed
weights, the chunked head against the plain `sequence_logprobs` path, the bf16 learner
against fp32, explicit devices and checkpoints that cross them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from specroll.model.config import ModelConfig
from specroll.model.transformer import Transformer
from specroll.rl.algo import loss as L
from specroll.rl.algo.batch import Batch
from specroll.rl.algo.logprobs import head_logprobs, sequence_logprobs
from specroll.rl.config import build_config
from tests.conftest import learner

CUDA = torch.cuda.is_available()


def tiny_policy(seed: int = 0, vocab: int = 97) -> Transformer:
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
    )
    return Transformer(cfg).init_weights(seed=seed, std=0.08)


def tiny_batch(vocab: int = 97, n: int = 10, width: int = 40, seed: int = 0) -> Batch:
    """Rows of different prompt and response lengths (every row has a response), with
    engine log-probs near the policy's scale on the response."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, width), generator=g)
    prompt = torch.randint(2, 12, (n,), generator=g)
    lengths = torch.maximum(torch.randint(14, width + 1, (n,), generator=g), prompt + 1)
    b = Batch(tokens, prompt, lengths, torch.randn(n, generator=g), torch.zeros(n, width))
    b.behaviour_logp = -4.5 * torch.rand(n, width, generator=g) * b.response_mask
    return b


# ---------------------------------------------------------------- importance weights


def test_importance_weight_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.3, 0.9, 0.2]]))
    beh = torch.log(torch.tensor([[0.25, 0.6, 0.3, 0.2]]))
    w, capped = L.importance_weight(old, beh, cap=2.5)
    # ratios 2, 0.5, 3 (capped at 2.5), 1
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 2.5, 1.0]]), rtol=1e-6)
    assert capped.tolist() == [[False, False, True, False]]
    assert not w.requires_grad


def test_weight_cap_combines_tis_and_decoupled_once():
    cfg = build_config("tiny").loss
    assert L.weight_cap(cfg, decoupled=False) is None  # both off
    assert L.weight_cap(cfg, decoupled=True) == cfg.behaviour_weight_cap
    cfg.tis_cap = 1.5
    assert L.weight_cap(cfg, decoupled=False) == 1.5
    assert L.weight_cap(cfg, decoupled=True) == min(1.5, cfg.behaviour_weight_cap)
    cfg.tis_cap = 5.0
    assert L.weight_cap(cfg, decoupled=True) == cfg.behaviour_weight_cap


def test_tis_scales_each_tokens_policy_gradient_by_its_weight():
    cfg = build_config("tiny", ["loss.tis_cap=2.0"]).loss
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g) * 3
    beh = old - torch.tensor([0.0, 0.5, -1.0, 1.5, -0.2])  # ratios 1, 1.6, 0.4, 4.5, 0.8
    logp = (old + 0.1 * torch.randn(3, 5, generator=g)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0])

    def grad(cap):
        per_tok, terms = L.token_objective(logp, old, adv, cfg, behaviour_logp=beh, cap=cap)
        (gr,) = torch.autograd.grad(per_tok.sum(), logp)
        return gr, terms

    plain, _ = grad(None)
    weighted, terms = grad(2.0)
    want = torch.exp(old - beh).clamp(max=2.0)  # min(pi_old / pi_engine, cap), by hand
    assert torch.allclose(weighted, plain * want, rtol=1e-6, atol=0)
    assert terms["capped"].equal(torch.exp(old - beh) > 2.0) and terms["capped"].any()


def test_learner_reports_the_capped_fraction():
    policy = tiny_policy()
    b = tiny_batch()
    lr = learner(policy, "loss.tis_cap=2.0")
    old = lr.logprobs(b)
    mask = b.response_mask
    # the engine gave the first three rows a third of the learner's probability (ratio 3)
    b.behaviour_logp = (old - math.log(3.0) * (torch.arange(10) < 3).float().view(-1, 1)) * mask
    stats = lr.train(b, old)
    assert stats["tis_clip_frac"] == pytest.approx(float(mask[:3].sum() / mask.sum()))
    assert "tis_clip_frac" not in learner(tiny_policy()).train(b, old)  # off by default


# ---------------------------------------------------------------- chunked head


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_the_plain_path(temperature):
    policy = tiny_policy().for_training()
    b = tiny_batch()
    L_ = policy.cfg.num_layers
    out = policy(b.tokens, hidden_layers=(L_,))
    want = sequence_logprobs(out.logits, b.tokens, temperature)  # [N, T]
    sel = b.response_mask[:, 1:]
    final = policy.final_state(out.hidden[L_])[:, :-1][sel]
    vocab = torch.tensor([0, 3, 5, 40, 96])
    for chunk in (1, 3, 7, 10_000):  # a lone last row, uneven chunks, one chunk
        got, target = head_logprobs(
            final, policy.head_weight, b.tokens[:, 1:][sel], temperature, vocab=vocab, chunk=chunk
        )
        assert (got - want[:, 1:][sel]).abs().max() <= 1e-5
        full = torch.log_softmax(out.logits[:, :-1][sel] / temperature, dim=-1)
        assert (target - full[:, vocab]).abs().max() <= 1e-5 and not target.requires_grad
    # gradients: the hand-written backward against autograd through the plain path
    w = policy.head_weight
    h = out.hidden[L_].detach().requires_grad_()
    plain = sequence_logprobs(policy.final_state(h) @ w, b.tokens, temperature)[:, 1:][sel]
    gw_plain, gh_plain = torch.autograd.grad((plain * 1.3).sum(), [w, h])
    final = policy.final_state(h)[:, :-1][sel]
    got, _ = head_logprobs(final, w, b.tokens[:, 1:][sel], temperature, chunk=7)
    gw, gh = torch.autograd.grad((got * 1.3).sum(), [w, h])
    for got_g, want_g in ((gw, gw_plain), (gh, gh_plain)):  # float rounding of the sums
        assert (got_g - want_g).abs().max() <= 1e-5 * want_g.abs().max()


def test_learner_logprobs_equal_the_plain_path():
    policy = tiny_policy()
    b = tiny_batch()
    lr = learner(policy, "rollout.temperature=0.8")
    got = lr.logprobs(b)
    with torch.no_grad():
        want = sequence_logprobs(policy(b.tokens).logits, b.tokens, 0.8) * b.response_mask
    assert got.device.type == "cpu" and got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-5


def test_on_policy_train_without_old_logprobs_equals_recomputing_them():
    b = tiny_batch()
    p1, p2 = tiny_policy(), tiny_policy()
    lr1, lr2 = learner(p1), learner(p2)
    s1 = lr1.train(b, lr1.logprobs(b))
    s2 = lr2.train(b, None)  # the train forward's own log-probs, detached
    assert s1 == s2
    pairs = zip(p1.parameters(), p2.parameters(), strict=True)
    assert all(torch.equal(a.grad, c.grad) for a, c in pairs)
    with pytest.raises(ValueError, match="updates_per_step"):
        learner(tiny_policy(), "loss.updates_per_step=2").train(b, None)


# ---------------------------------------------------------------- bf16


def test_bf16_learner_trains_fp32_masters_and_stays_near_fp32():
    from specroll.drafting.train import new_eagle3

    b = tiny_batch()
    p32, p16 = tiny_policy(), tiny_policy()
    d16 = new_eagle3(p16, torch.arange(0, 97, 2), (1, 2, 3), 0)
    lr32 = learner(p32)
    lr16 = learner(p16, "learner.dtype=bfloat16", draft=d16)
    old32, old16 = lr32.logprobs(b), lr16.logprobs(b)
    mask = b.response_mask
    err = (old16 - old32).abs()[mask]
    # bf16 keeps 8 mantissa bits: products rounded at ~0.4%, and a token's log-prob
    # moves by up to ~0.02 nat on this model (mean ~0.005; bounds at 3x)
    assert err.max() <= 0.06 and err.mean() <= 0.015, (err.max(), err.mean())  # 0.02, 0.005
    stats = lr16.train(b, old16 - 0.05 * mask)
    assert all(math.isfinite(v) for v in stats.values() if isinstance(v, float))
    assert stats["grad_norm"] > 0 and stats["draft_grad_norm"] > 0
    for p in [*p16.parameters(), *d16.parameters()]:
        assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
    for opt in (lr16.opt, lr16.draft_opt):
        for st in opt.state.values():
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32


# ---------------------------------------------------------------- devices


def _host(policy, device):
    from specroll.rl.learner.single import LocalLearnerHost

    cfg = build_config("tiny", ["policy.micro_batch=4"])
    return LocalLearnerHost(cfg, policy, None, torch.device(device))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))],
)
def test_learner_on_an_explicit_device_moves_batches(device):
    b = tiny_batch()  # on the CPU
    policy = tiny_policy()
    host = _host(policy, device)
    assert next(policy.parameters()).device.type == device
    old, ref = host.logprobs(b)
    assert old.device.type == "cpu" and old.dtype == torch.float32 and ref is None
    stats = host.train(b, old - 0.05 * b.response_mask, None)
    assert all(isinstance(v, float) for v in stats.values() if not isinstance(v, list))
    state = host.checkpoint_state()
    assert all(t.device.type == "cpu" for t in state["policy"].values())
    assert all(
        t.device.type == "cpu"
        for s in state["policy_opt"]["state"].values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_a_gpu_checkpoint_restores_on_the_cpu_and_back():
    b = tiny_batch()
    gpu = _host(tiny_policy(), "cuda")
    old, _ = gpu.logprobs(b)
    gpu.train(b, old - 0.05 * b.response_mask, None)
    state = copy.deepcopy(gpu.checkpoint_state())
    cpu = _host(tiny_policy(seed=1), "cpu")
    cpu.restore(state)
    assert (cpu.logprobs(b)[0] - gpu.logprobs(b)[0]).abs().max() <= 1e-4
    back = _host(tiny_policy(seed=2), "cuda")
    back.restore(cpu.checkpoint_state())
    s1 = gpu.train(b, old, None)
    s2 = back.train(b, old, None)
    assert s1["policy_loss"] == pytest.approx(s2["policy_loss"], rel=1e-4, abs=1e-6)
