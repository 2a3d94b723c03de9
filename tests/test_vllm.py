"""vLLM as a rollout backend (`specroll.rl.rollout.vllm`), on tiny models through vLLM.

* Greedy: token-identical to specroll's own engine (EAGLE-3 k = 3), stop tokens included.
* Log-probs: vLLM's processed log-probs of speculative samples equal the learner's
  recomputation (fp32) to float rounding.
* Refit: an engine refit in place (policy and draft) generates what a fresh engine on the
  new weights generates — same seeds, same tokens, same acceptance counters — and the
  counters agree with vLLM's own `get_metrics()`.
* Exactness: the joint distribution of three tokens sampled with speculation through vLLM
  matches plain decoding's exact distribution (the χ² method of tests/test_spec_engine.py,
  helpers in tests/conftest.py); without the backend's patch of vLLM's CPU sampling-parameter
  expansion the same test fails (the control), and the counts reject a 2% TV shift (power).

vLLM's CPU attention takes head sizes 32, 64, ...: these models use head_dim 32. Skipped
only when vLLM is not importable (`.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm.py`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import PROMPT, VOCAB, chi2_pvalue, exact_joint, learner, tv_shifted

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head  # noqa: E402
from specroll.drafting.eagle3_io import save_eagle3  # noqa: E402
from specroll.engine import Engine, Request, SamplingParams  # noqa: E402
from specroll.model import ModelConfig, Transformer  # noqa: E402
from specroll.model.weights import save_model  # noqa: E402
from specroll.rl.algo.batch import Batch  # noqa: E402
from specroll.rl.replica import ReplicaSpec, Weights  # noqa: E402
from specroll.rl.rollout.vllm import VllmRollout  # noqa: E402
from specroll.rl.rollout.vllm_patch import patch_expand  # noqa: E402

pytestmark = pytest.mark.vllm

K = 3
N = 30_000


def _target(seed: int, std: float = 0.4) -> Transformer:
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=512,
    )
    return Transformer(cfg).init_weights(seed=seed, std=std).eval()


def _draft(target: Transformer, seed: int) -> Eagle3Head:
    """A random EAGLE-3 head over 12 of the 16 ids, reading distinct ascending target
    layers (vLLM dedupes and sorts aux ids; `for_target` on 4 layers gives (2, 2, 1))."""
    cfg = Eagle3Config.from_layer(target.cfg, 12, (1, 2, 3))
    return Eagle3Head(cfg, embed=target).init_weights(seed, 0.3).eval()


def _save(root, target: Transformer, draft: Eagle3Head) -> tuple[str, str]:
    save_model(target, root / "policy")
    save_eagle3(draft, root / "draft")
    return str(root / "policy"), str(root / "draft")


def _engine(root, target, draft, **kw) -> VllmRollout:
    policy_dir, draft_dir = _save(root, target, draft)
    kw = {"max_batch": 64, "kv_cache_gib": 0.25, **kw}
    return VllmRollout(policy_dir, draft_dir, "eagle3", K, **kw)


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 15) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (m,), generator=g).tolist() for m in lengths]


def metric_counters(llm) -> dict:
    """vLLM's global speculation counters now (`get_metrics`): drafts, draft_tokens,
    accepted_tokens (ints) and per_pos (list); take differences around a call."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in names:
            out[names[m.name]] += m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            have = out["per_pos"] or [0] * len(m.values)
            out["per_pos"] = [a + b for a, b in zip(have, m.values, strict=True)]
    return out


# ---------------------------------------------------------------- greedy, log-probs


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(target, draft, its vLLM rollout) with realistic activation scales."""
    target = _target(0, std=0.15)
    draft = _draft(target, 3)
    return target, draft, _engine(tmp_path_factory.mktemp("small"), target, draft)


def test_greedy_is_token_identical_to_specroll_engine(small):
    target, _, roll = small
    prompts = _prompts(4, seed=4)
    params = SamplingParams(0.0, max_new_tokens=64, stop_token_ids=())
    ours = Engine(target).generate([Request(q, params) for q in prompts])
    theirs = roll.generate_now([Request(q, params) for q in prompts])
    assert theirs.stats.draft_tokens > 0
    for q, a, b in zip(prompts, ours, theirs, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == "length" and b.draft_version == 0
        logits = target(torch.tensor([q + b.token_ids])).logits[0, len(q) - 1 : -1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(b.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(b.logprobs), ref, atol=1e-5, rtol=0)
    # a stop token inside the output ends it there, the stop token included
    stop = ours[0].token_ids[10]
    params = SamplingParams(0.0, max_new_tokens=64, stop_token_ids=(stop,))
    ours = Engine(target).generate([Request(q, params) for q in prompts])
    theirs = roll.generate_now([Request(q, params) for q in prompts])
    for a, b in zip(ours, theirs, strict=True):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_processed_logprobs_equal_the_learners_recomputation(small, temperature):
    target, _, roll = small
    params = [
        SamplingParams(temperature, max_new_tokens=32, stop_token_ids=(), seed=i) for i in range(16)
    ]
    res = roll.generate_now([Request(q, p) for q, p in zip(_prompts(16, 5), params, strict=True)])
    assert res.stats.accepted_tokens > 0 and res.stats.acceptance_rate < 0.95
    assert [r.seed for r in res] == list(range(16))
    b = Batch.from_results(list(res), torch.zeros(len(res)))
    old = learner(target, f"rollout.temperature={temperature}").logprobs(b)
    delta = (old - b.behaviour_logp)[b.response_mask].abs().max().item()
    print(f"T={temperature}: max |vLLM - learner| = {delta:.2e}")
    assert delta < 1e-4


# ---------------------------------------------------------------- refit


def _refit_requests() -> list[Request]:
    """Sampled and greedy rows; the long ones share a prefix of more than two KV blocks
    (128 tokens on CPU; with EAGLE vLLM does not reuse the last cached block), so a prefix
    cache kept across the refit would serve them stale blocks."""
    long = _prompts(1, 8, 300, 301)[0]
    prompts = _prompts(8, 7) + [long + q for q in _prompts(4, 9)]
    reqs = []
    for i, q in enumerate(prompts):
        t = 0.0 if i % 4 == 3 else 1.0
        reqs.append(Request(q, SamplingParams(t, max_new_tokens=24, stop_token_ids=(), seed=i)))
    return reqs


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        sx, sy = x.spec, y.spec
        assert (sx.drafts, sx.draft_tokens, sx.accepted_tokens, sx.accepted_per_pos) == (
            sy.drafts,
            sy.draft_tokens,
            sy.accepted_tokens,
            sy.accepted_per_pos,
        )
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_refit_in_place_equals_a_fresh_engine(tmp_path):
    old_t = _target(0)
    old_d = _draft(old_t, 3)
    new_t = _target(1)
    new_d = _draft(new_t, 4)
    roll = _engine(tmp_path / "old", old_t, old_d)
    reqs = _refit_requests()
    before = roll.generate_now(reqs)  # fills the prefix cache with old-weight blocks
    times = []
    for v in (1, 2):  # the second refit: timing without first-call effects
        roll.update_weights(v, Weights.of(new_t, new_d))
        times.append(roll.refit_s)
    print(
        f"refit (policy + draft, {sum(p.numel() for p in new_t.parameters())} params): "
        f"{times[0] * 1e3:.0f} ms, then {times[1] * 1e3:.0f} ms"
    )
    refit = roll.generate_now(reqs)
    assert all((r.policy_version, r.draft_version) == (2, 2) for r in refit)
    assert [r.token_ids for r in refit] != [r.token_ids for r in before]
    fresh = _engine(tmp_path / "new", new_t, new_d)  # registered last: get_metrics is its
    c0 = metric_counters(fresh.llm)
    again = fresh.generate_now(reqs)
    c1 = metric_counters(fresh.llm)
    _same(refit, again)
    s = again.stats
    assert s.drafts > 0 and 0 < s.acceptance_rate < 0.95
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == tuple(
        c1[n] - c0[n] for n in ("drafts", "draft_tokens", "accepted_tokens")
    )
    assert s.accepted_per_pos == [
        b - a for a, b in zip(c0["per_pos"] or [0] * K, c1["per_pos"], strict=True)
    ]
    # the plain shadow engine, made after the refit, starts on the refit weights
    greedy = [r for r in reqs if r.params.temperature == 0.0]
    plain = roll.generate_now(greedy, plain=True)
    assert all(r.draft_version is None and r.policy_version == 2 for r in plain)
    assert [r.token_ids for r in plain] == [r.token_ids for r in fresh.generate_now(greedy)]


def test_refit_on_ray_workers_equals_fresh_workers(tmp_path):
    """`rollout.backend: ray` with `ray.worker_backend: vllm`: each of two workers starts a
    vLLM engine on the first weights it is sent and refits in place on the next ones; the
    refit workers then generate what workers started on the new weights generate."""
    ray = pytest.importorskip("ray")
    from specroll.rl.config import RayConfig, TrainConfig
    from specroll.rl.config.rollout import RolloutConfig
    from specroll.rl.rollout.ray import RayRollout

    old_t, new_t = _target(0), _target(1)
    old_d, new_d = _draft(old_t, 3), _draft(new_t, 4)
    cfg = TrainConfig(
        rollout=RolloutConfig(k=K, depth="fixed", max_batch=16, device="cpu"),
        ray=RayConfig(worker_backend="vllm", workers=2),
    )
    spec = ReplicaSpec.of(old_t, old_d)
    reqs = _refit_requests()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        roll = RayRollout(cfg, spec, [])
        roll.update_weights(0, Weights.of(old_t, old_d))
        before = roll.generate(reqs)
        roll.update_weights(1, Weights.of(new_t, new_d))
        refit = roll.generate(reqs)
        roll.close()
        fresh = RayRollout(cfg, spec, [])
        fresh.update_weights(1, Weights.of(new_t, new_d))
        again = fresh.generate(reqs)
        fresh.close()
    finally:
        ray.shutdown()
    assert all((r.policy_version, r.draft_version) == (0, 0) for r in before)
    assert all((r.policy_version, r.draft_version) == (1, 1) for r in refit)
    assert [r.token_ids for r in refit] != [r.token_ids for r in before]
    _same(refit, again)
    assert refit.stats.drafts > 0
    assert refit.stats.accepted_per_pos == again.stats.accepted_per_pos


# ---------------------------------------------------------------- bench backends


def test_bench_backends_compares_both_engines_on_the_same_requests(tmp_path):
    """`specroll bench backends`: both engines, plain and EAGLE-3, same requests; vLLM's
    rows carry its acceptance from its counters, the own engine's the ratio against it.
    (Before the χ² tests: vLLM 0.32 starts no engine in a process where an n-gram engine
    has run, docs/vllm_cpu_defects.md.)"""
    from specroll.rl.rollout.bench import bench_backends

    target = _target(0, std=0.15)
    policy_dir, draft_dir = _save(tmp_path, target, _draft(target, 3))
    report = bench_backends(
        target,
        _prompts(3, 1),
        policy_dir,
        draft_dir,
        batches=[1, 4],
        k=K,
        new_tokens=8,
        repeats=1,
        log=lambda _: None,
    )
    rows = {(r["backend"], r["mode"], r["batch"]): r for r in report["rows"]}
    assert len(rows) == 8
    for B in (1, 4):
        for mode in ("ar", "eagle3"):
            assert rows[("local", mode, B)]["own_over_vllm"] > 0
        for backend in ("local", "vllm"):
            spec = rows[(backend, "eagle3", B)]
            assert 1.0 <= spec["acceptance_length"] <= K + 1
            assert len(spec["per_position"]) == K


# ---------------------------------------------------------------- LoRA (merged refits)


def test_a_lora_policy_refits_merged_equals_a_fresh_engine_and_samples_exactly(tmp_path):
    """A LoRA policy on vLLM: refits carry only the adapters, which the backend merges
    into its kept base. After a refit to new adapters the engine equals a fresh engine
    started on the merged policy (tokens, log-probs, speculation counts), and its joint
    distribution of three tokens is the adapted policy's (chi-square, with the power
    control and the base policy's distribution rejected). (Before the n-gram engines of
    the chi-square section: vLLM 0.32 starts no engine after one, docs/vllm_cpu_defects.md.)"""
    from specroll.model import lora
    from specroll.rl.config import build_config
    from specroll.rl.rollout.vllm import from_modules

    def adapted(seed: int) -> Transformer:
        model = _target(0)
        lora.attach(model, lora.LoraSpec(4, 8.0, lora.expand_targets([lora.ALL])), seed=seed)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, w in model.named_parameters():
                if ".lora.B." in name:
                    w.copy_(torch.randn(w.shape, generator=g) * 0.3)
        return model

    over = [
        "rollout.backend=vllm",
        "rollout.depth=fixed",
        f"rollout.k={K}",
        "rollout.max_batch=256",
    ]
    rollout = build_config("tiny", over).rollout
    old, new = adapted(1), adapted(2)
    draft = _draft(old, 3)
    roll = from_modules(rollout, old, draft)
    reqs = _refit_requests()
    before = roll.generate_now(reqs)
    roll.update_weights(1, Weights.of(new, None))
    assert set(Weights.of(new, None).policy) == set(lora.adapters(new))
    refit = roll.generate_now(reqs)
    assert [r.token_ids for r in refit] != [r.token_ids for r in before]
    counts, s = _joint_counts(roll, N, 1.0, 0, 1.0)  # (before another engine starts)
    assert s.draft_tokens > N // 2
    exact = exact_joint(new, 1.0, 0, 1.0)
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4
    assert chi2_pvalue(counts, exact_joint(_target(0), 1.0, 0, 1.0)) < 1e-6
    merged = lora.merge(copy.deepcopy(new))
    _same(refit, _engine(tmp_path / "fresh", merged, draft, max_batch=256).generate_now(reqs))


# ---------------------------------------------------------------- exactness (χ²)


@pytest.fixture(scope="module")
def chi(tmp_path_factory):
    """(target, method -> its vLLM rollout, started on first use)."""
    target = _target(0)
    policy_dir, draft_dir = _save(tmp_path_factory.mktemp("chi"), target, _draft(target, 3))
    rolls: dict[str, VllmRollout] = {}

    def get(method: str) -> VllmRollout:
        if method not in rolls:
            kind, _, sample = method.partition("-")  # eagle3-probabilistic: drafts from q
            d = draft_dir if kind == "eagle3" else None
            rolls[method] = VllmRollout(
                policy_dir,
                d,
                kind,
                K,
                max_batch=256,
                kv_cache_gib=0.25,
                ngram_max=2,
                draft_sample=sample or "greedy",
            )
        return rolls[method]

    yield target, get
    patch_expand(True)


def _joint_counts(roll: VllmRollout, n: int, t: float, k: int, p: float):
    reqs = [
        Request(
            PROMPT, SamplingParams(t, top_k=k, top_p=p, max_new_tokens=3, stop_token_ids=(), seed=i)
        )
        for i in range(n)
    ]
    res = roll.generate_now(reqs)
    ids = torch.tensor([r.token_ids for r in res])  # [N, 3]
    flat = ids[:, 0] * VOCAB**2 + ids[:, 1] * VOCAB + ids[:, 2]
    return torch.bincount(flat, minlength=VOCAB**3), res.stats


@pytest.mark.parametrize("t,k,p", [(0.7, 0, 1.0), (1.0, 0, 1.0), (1.0, 0, 0.85)])
@pytest.mark.parametrize("method", ["eagle3", "eagle3-probabilistic", "ngram"])
def test_joint_distribution_through_vllm_matches_plain_decoding(chi, method, t, k, p):
    """A random EAGLE-3 head is rarely accepted here, so it exercises rejection and the
    residual, with vLLM's greedy drafts (the argmax of q, accepted with p(argmax): the
    backend's default) and with drafts sampled from q (as specroll's engine drafts);
    n-gram on the repetitive prompt is accepted often."""
    target, get = chi
    roll = get(method)
    assert roll.patched  # on this CPU build the backend must patch vLLM
    counts, s = _joint_counts(roll, N, t, k, p)
    # speculation happened; EAGLE-3 exercises rejections (residual draws), n-gram
    # acceptances (with top-p 0.85 the prompt's continuation is the whole nucleus)
    assert s.draft_tokens > N // 2
    if method.startswith("eagle3"):
        assert s.draft_tokens - s.accepted_tokens > N // 2
    else:
        assert s.acceptance_rate > 0.05
    exact = exact_joint(target, t, k, p)
    pv, shifted = chi2_pvalue(counts, exact), chi2_pvalue(counts, tv_shifted(exact, 0.02))
    print(
        f"{method} T={t} top_k={k} top_p={p}: p={pv:.3g}, 2%-shifted p={shifted:.2g}, "
        f"acceptance {s.acceptance_rate:.4f}"
    )
    assert pv > 1e-4
    assert shifted < 1e-4


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_the_same_test_fails_without_the_patch(chi, method):
    """The control: vLLM's own CPU expansion (garbage temperatures in the verifier)."""
    target, get = chi
    roll = get(method)
    patch_expand(False)
    try:
        counts, _ = _joint_counts(roll, N // 3, 1.0, 0, 1.0)
    finally:
        patch_expand(True)
    exact = exact_joint(target, 1.0, 0, 1.0)
    observed = counts.double() / counts.sum()
    tv = 0.5 * (observed - exact).abs().sum().item()
    pv = chi2_pvalue(counts, exact) if counts[exact == 0].sum() == 0 else 0.0
    print(f"{method} unpatched: p={pv:.3g}, TV={tv:.3f}")
    assert pv < 1e-6 and tv > 0.02


def test_ngram_rollout_serves_plain_shadow_rollouts(chi):
    """The n-gram rollout's plain engine (shadow rollouts) works after n-gram generation:
    vLLM 0.32 starts no engine once an n-gram one has run in the process, so the backend
    starts the plain one first. Greedy: both give the same tokens."""
    _, get = chi
    roll = get("ngram")  # has generated already (the chi-square tests above)
    reqs = [
        Request(PROMPT, SamplingParams(0.0, max_new_tokens=6, stop_token_ids=(), seed=i))
        for i in range(4)
    ]
    spec = roll.generate_now(reqs)
    plain = roll.generate_now(reqs, plain=True)
    assert spec.stats.draft_tokens > 0
    assert [r.token_ids for r in plain] == [r.token_ids for r in spec]


# ---------------------------------------------------------------- export


def _clear_greedy(model, prompts: list[list[int]], n: int, margin: float = 1e-3) -> list:
    """The prompts whose first n greedy tokens under `model` never come within `margin`
    of a tie (greedy decoding is defined only up to ties: rounding may break them
    differently in another implementation)."""
    keep = []
    for q in prompts:
        seq, gaps = list(q), []
        with torch.no_grad():
            for _ in range(n):
                top = model(torch.tensor([seq])).logits[0, -1].topk(2)
                gaps.append(float(top.values[0] - top.values[1]))
                seq.append(int(top.indices[0]))
        if min(gaps) > margin:
            keep.append(q)
    return keep


def test_an_exported_run_loads_in_vllm_with_its_draft(tmp_path, monkeypatch):
    """`specroll export` of a trained run (sharded) serves in vLLM with its EAGLE-3 draft:
    transformers gives the export's logits, and vLLM's greedy tokens equal specroll's
    engine's on the export (on prompts whose greedy path has no near-tie)."""
    from transformers import AutoModelForCausalLM

    from specroll.cli import main
    from specroll.model import load_model
    from specroll.model.tiny import build_tiny
    from tests.conftest import train_tiny

    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    # the tiny policy's tokenizer on a body vLLM's CPU attention takes (head_dim 32) and
    # with 8 layers, so the draft's aux layers (2, 4, 5) are distinct
    base = build_tiny(tmp_path / "base")
    vocab = load_model(base).cfg
    cfg = ModelConfig(
        vocab_size=vocab.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_layers=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        eos_token_id=vocab.eos_token_id,
    )
    save_model(Transformer(cfg).init_weights(seed=0, std=0.15), base)
    run, out = tmp_path / "run", tmp_path / "export"
    small = ("data.val_size=0", "data.prompts_per_step=2", "data.group_size=2")
    sets = [x for kv in (f"policy.model={base}", *small) for x in ("--set", kv)]
    assert train_tiny(run, "--steps", "1", *sets) == 0
    assert main(["export", str(run), "--out", str(out), "--max-shard-size", "100KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    ours = load_model(out).eval()
    prompts = _clear_greedy(ours, _prompts(6, seed=5, hi=12), n=24)
    assert len(prompts) >= 3
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, atol=1e-5, rtol=1e-5)
    params = SamplingParams(0.0, max_new_tokens=24, stop_token_ids=())
    want = Engine(ours).generate([Request(q, params) for q in prompts])
    # vLLM in a process of its own: a second engine in this one disturbs the module's
    # engine, and once the ngram proposer has loaded numba vLLM 0.32's CPU kernel
    # registration (run by every new engine) fails scanning llvmlite's objects
    code = (
        "import json, sys\n"
        "from specroll.engine import Request, SamplingParams\n"
        "from specroll.rl.rollout.vllm import VllmRollout\n"
        "out, k, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])\n"
        "roll = VllmRollout(out, out + '/draft', 'eagle3', k, max_batch=8, kv_cache_gib=0.25)\n"
        "p = SamplingParams(0.0, max_new_tokens=24, stop_token_ids=())\n"
        "got = roll.generate_now([Request(q, p) for q in prompts])\n"
        "print(json.dumps([got.stats.draft_tokens, [r.token_ids for r in got]]))\n"
    )
    args = [sys.executable, "-c", code, str(out), str(K), json.dumps(prompts)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    drafted, tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert drafted > 0  # the exported draft served
    assert tokens == [r.token_ids for r in want]


def test_history_on_vllm_uses_its_suffix_method_or_says_what_it_needs():
    """rollout.drafter=history on vLLM is vLLM's suffix method, which needs the
    arctic-inference package (not installed in the CPU suite's environment): refused
    before any model loads, naming the package and the alternatives; the combined
    drafter has no vLLM counterpart."""
    import importlib.util

    from specroll.rl.config import build_config
    from specroll.rl.rollout.vllm import suffix_method

    cfg = build_config("tiny", ["rollout.backend=vllm", "rollout.drafter=history"]).rollout
    if importlib.util.find_spec("arctic_inference") is None:
        with pytest.raises(ValueError, match="arctic-inference.*rollout.backend=local"):
            suffix_method(cfg, "rollout.backend=vllm")
    else:
        assert suffix_method(cfg, "rollout.backend=vllm")
    combined = build_config("tiny", ["rollout.drafter=history+eagle3"]).rollout
    with pytest.raises(ValueError, match="no rollout.drafter=history.eagle3"):
        suffix_method(combined, "rollout.backend=vllm")
    assert not suffix_method(build_config("tiny").rollout, "rollout.backend=vllm")
