"""The captured step (`engine.graphs`): the decoding step padded to a batch bucket over the
whole cache, reading every input from buffers, emits what the engine emits without it.

CUDA graphs need a GPU (benchmarks/gpu_check.py times them there); here the CPU takes
the static path with its stand-in for capture, which replays the same function over the
same buffers: a step that read a per-iteration value from anywhere but its buffers, or
let a padding row write what it should not, would change the tokens."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from benchmarks.host_syncs import count, drafters, model, requests
from benchmarks.same_tokens import OnOff, random_requests
from specroll import device
from specroll.engine import graphs
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.forms import FormChoice
from specroll.engine.request import Request, SamplingParams
from tests.conftest import (
    JOINT_SAMPLES,
    chi2_pvalue,
    exact_joint,
    sample_joint,
    spec_drafters,
    spec_model,
    tv_shifted,
)

KINDS = ["plain", "ngram", "draft_model", "eagle3", "mtp", "history", "combined"]


def _outputs(results) -> list[tuple]:
    return [
        (r.token_ids, r.logprobs, r.finish_reason, r.spec.accepted_tokens, r.spec.draft_tokens)
        for r in results
    ]


def _close(got: list, want: list) -> bool:
    """Tokens, finish reasons and drafts identical; log-probs within 1e-4 (a matmul of
    another shape rounds differently: 2e-5 measured)."""
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            if a[0] != b[0] or a[2:] != b[2:]:
                return False
            if max((abs(x - y) for x, y in zip(a[1], b[1], strict=True)), default=0) > 1e-4:
                return False
    return True


def _engine(name: str, target, max_batch: int, seed: int, graphs_on: bool) -> Engine:
    drafter = drafters(target)[name]()
    k = 8 if drafter is not None and drafter.tree else 3
    depth = FixedDepth(k=k, max_batch=64) if drafter is not None else None
    config = EngineConfig(max_batch=max_batch, seed=seed, cuda_graphs=graphs_on)
    return Engine(target, config, drafter, depth)


def _run(name: str, target, max_batch: int, seed: int, graphs_on: bool, reqs):
    eng = _engine(name, target, max_batch, seed, graphs_on)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random drafts: the collapse warning is expected
        out = [_outputs(eng.generate(reqs)) for _ in range(2)]  # graphs again in a 2nd call
    return out, eng.stats


@pytest.fixture
def captured_on_cpu(monkeypatch):
    monkeypatch.setattr(graphs, "CAPTURE_ON", ("cuda", "cpu"))
    # which form fills the combined drafter's budget reads wall time: hold it fixed
    monkeypatch.setattr(FormChoice, "choose", lambda self, k: "merged")


@pytest.fixture
def eager_shapes(monkeypatch):
    """The captured step at the eager step's shapes (no padding rows, the deepest row's key
    axis): what differs is then the buffers, the masks and the replays, which must change
    nothing. (Other shapes round differently: a matmul's kernel depends on its M.)"""
    monkeypatch.setattr(graphs, "key_bucket", lambda need, max_len: need)
    monkeypatch.setattr(graphs, "bucket", lambda B, slots: B)


@pytest.mark.parametrize("name", KINDS)
def test_the_static_step_emits_the_engines_tokens(name, captured_on_cpu, eager_shapes):
    """Plain and speculative, greedy and sampled (top-k, top-p) rows, over seeds and batch
    sizes, two calls each: the same tokens, log-probs and drafts, bit for bit. (A tree
    is the exception for log-probs: its graph scores all k nodes where the eager step
    scores as many as its fullest row has, and walks it masked, so its sums round
    differently; its tokens and drafts are the same.)"""
    target = model()
    reqs = requests(15)
    tree = drafters(target)[name]() is not None and drafters(target)[name]().tree
    for seed, max_batch in [(0, 7), (1, 3)]:
        want, _ = _run(name, target, max_batch, seed, False, reqs)
        got, stats = _run(name, target, max_batch, seed, True, reqs)
        assert _close(got, want) if tree else got == want, (name, seed, max_batch)
        assert 0 < stats.graphs <= graphs.MAX_GRAPHS


@pytest.mark.parametrize("name", ["draft_model", "eagle3", "mtp"])
def test_a_lagging_draft_catches_up_before_the_static_step(name, captured_on_cpu, eager_shapes):
    """After plain iterations a draft lags more than a captured step feeds: it is fed
    eagerly first (`prepare_static`), and the tokens are the eager engine's."""
    target, reqs = model(), requests(17)
    outs = []
    for on in (False, True):
        config = EngineConfig(max_batch=5, seed=7, cuda_graphs=on)
        eng = Engine(target, config, drafters(target)[name](), OnOff(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs.append(_outputs(eng.generate(reqs)))
    assert outs[0] == outs[1] and eng.stats.graphs > 0


@pytest.mark.parametrize("name", ["plain", "draft_model", "eagle3", "history"])
def test_buckets_change_rounding_not_greedy_tokens(name, captured_on_cpu):
    """A graph's batch is padded to its bucket and its key axis runs past the deepest row
    (here to the whole cache): that changes how sums round (log-probs within 1e-4),
    never a greedy token, and padding rows stay as they were (below)."""
    target = model()
    greedy = [
        Request(r.prompt_ids, SamplingParams(max_new_tokens=24, temperature=0.0))
        for r in requests(15)
    ]
    want, _ = _run(name, target, 7, 0, False, greedy)
    got, _ = _run(name, target, 7, 0, True, greedy)
    assert _close(got, want)


def test_the_static_steps_law_is_exact(captured_on_cpu):
    """With buckets, a sampled token may differ from the eager step's where a uniform
    falls within rounding of a boundary: what must hold is the law. The chi-square test
    of tests/test_spec_engine.py, on the captured step."""
    target = spec_model(0)
    d = spec_drafters(target)["draft_model"]()
    engine = Engine(target, EngineConfig(max_batch=512, cuda_graphs=True), d, FixedDepth(3))
    counts = sample_joint(engine, JOINT_SAMPLES, 1.0, 0, 1.0, mixed=True)
    assert engine.stats.graphs > 0 and engine.stats.draft_tokens > JOINT_SAMPLES // 2
    exact = exact_joint(target, 1.0, 0, 1.0)
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


def test_the_static_tree_steps_law_is_exact(captured_on_cpu):
    """The same for trees (tests/test_tree.py's random trees of 16 nodes, top-p): padded
    to the bucket and to all 16 nodes, walked masked."""
    from tests.test_tree import RandomTree

    target = spec_model(0)
    config = EngineConfig(max_batch=512, cuda_graphs=True)
    engine = Engine(target, config, RandomTree(16), FixedDepth(16))
    counts = sample_joint(engine, JOINT_SAMPLES, 1.0, 0, 0.85, mixed=True)
    s = engine.stats
    assert s.graphs > 0 and 0.05 < s.acceptance_rate < 0.95
    exact = exact_joint(target, 1.0, 0, 0.85)
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


def test_graphs_past_the_bound_run_eagerly_and_change_nothing(
    captured_on_cpu, eager_shapes, monkeypatch
):
    target = model()
    reqs = requests(15)
    want, _ = _run("eagle3", target, 7, 0, False, reqs)
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 1)
    got, stats = _run("eagle3", target, 7, 0, True, reqs)
    assert got == want and stats.graphs == 1


def test_the_static_step_reads_the_device_back_once(captured_on_cpu):
    target = model()
    for name in ("plain", "eagle3", "draft_model"):
        r = count(_engine(name, target, 4, 0, True))
        assert r["syncs_per_iteration_max"] == 1, (name, r)


def test_graphs_are_off_on_the_cpu_and_on_request():
    """`cuda_graphs` is a CUDA setting: a CPU engine runs its own path whatever it says."""
    target = model()
    reqs = [Request([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))]
    for on in (False, True):
        eng = Engine(target, EngineConfig(max_batch=2, cuda_graphs=on))
        eng.generate(reqs)
        assert eng.stats.graphs == 0 and eng.captured is None


def test_buckets_hold_the_batch_within_the_slots():
    assert [graphs.bucket(B, 64) for B in (1, 2, 3, 5, 17, 33, 64)] == [1, 2, 4, 8, 24, 48, 64]
    assert graphs.bucket(5, 6) == 6 and graphs.bucket(700, 1000) == 1000
    assert [graphs.key_bucket(n, 4096) for n in (1, 128, 129, 3000, 5000)] == [
        128,
        128,
        256,
        4096,
        4096,
    ]
    assert all(graphs.bucket(B, S) >= B for S in (1, 7, 300) for B in range(1, S + 1))


def test_a_padding_row_keeps_its_slot_untouched(captured_on_cpu):
    """A bucket's padding rows are free slots: after a step they hold what they held, on
    the device (its data) and on the host (its state)."""
    target = model()
    eng = _engine("eagle3", target, 4, 0, True)
    reqs = [
        Request([5, 6, 7], SamplingParams(max_new_tokens=4 * (s + 1), temperature=1.0, seed=s))
        for s in range(4)
    ]  # 4 slots; 3 rows live after the first finishes: a bucket of 4
    seen = []
    step = eng._step

    def spy(st, B, ctx):
        before = [t[B:].clone() for t in st.data()]
        host = [list(h[B:]) for h in st.host.lists()]
        out = step(st, B, ctx)
        if B < len(st.pos):  # a padded step: the rows past B are padding
            after = [t[B:] for t in st.data()]
            same = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
            seen.append(same and host == [list(h[B:]) for h in st.host.lists()])
        return out

    eng._step = spy
    eng.generate(reqs)
    assert seen and all(seen)


@pytest.mark.parametrize(
    "trial", [*range(24), *(pytest.param(t, marks=pytest.mark.slow) for t in range(24, 40))]
)
def test_random_requests_give_the_same_tokens_on_the_static_step(
    trial, captured_on_cpu, eager_shapes
):
    """Random prompts, budgets, stop ids, draft caps, sampling settings, slot counts and
    depths switching on and off: the captured step's tokens, finish reasons and drafts are
    the eager step's. (Not MTP with several heads: its depth-2 step reads a cache position
    no pair of the proposal wrote, so the two paths draft from different leftovers.)"""
    rnd = random.Random(trial)
    name = rnd.choice(["plain", "ngram", "draft_model", "eagle3", "history", "combined"])
    reqs = random_requests(rnd, rnd.randint(1, 12), 40, 60)
    max_batch = rnd.randint(1, 8)
    tree = name in ("history", "combined")
    k = rnd.choice([2, 4, 8, 16] if tree else [1, 2, 3, 5])
    target = model()
    outs = []
    for on in (False, True):
        drafter = drafters(target)[name]()
        depth = OnOff(k) if drafter is not None else None
        eng = Engine(
            target, EngineConfig(max_batch=max_batch, seed=trial, cuda_graphs=on), drafter, depth
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = eng.generate(reqs)
        outs.append([(r.token_ids, r.finish_reason, r.spec.accepted_tokens) for r in res])
    assert outs[0] == outs[1], (name, max_batch, k)


def test_a_capture_that_fails_leaves_its_step_eager(captured_on_cpu, eager_shapes, monkeypatch):
    """A step shape whose capture raises runs eagerly from then on, with a warning and
    the reason kept; the tokens are unchanged."""
    target, reqs = model(), requests(15)
    want, _ = _run("eagle3", target, 7, 0, False, reqs)

    def broken(self, step):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.Graphs, "_capture", broken)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        eng = _engine("eagle3", target, 7, 0, True)
        got = [_outputs(eng.generate(reqs)) for _ in range(2)]
    assert got == want
    assert eng.stats.graphs == 0 and eng.stats.graph_failures > 0
    assert "not permitted" in next(iter(eng.captured.failed.values()))


@pytest.mark.parametrize("trial", range(3))
def test_the_tree_chosen_on_the_device_gives_the_same_tokens_captured(
    trial, captured_on_cpu, monkeypatch
):
    """The combined drafter's merged tree chosen on the device (trees walked masked, as on
    an accelerator), through the captured step over padded buckets, what it chose riding
    back on the one read: the tokens, finish reasons and drafts of the host's choice."""
    rnd = random.Random(100 + trial)
    reqs = random_requests(rnd, rnd.randint(4, 12), 40, 60)
    max_batch, k = rnd.randint(2, 8), rnd.choice([4, 8, 16])
    target = model()
    outs = []
    for masked in (False, True):
        monkeypatch.setattr(device, "HOST_PACED", () if masked else ("cpu",))
        depth = OnOff(k)
        config = EngineConfig(max_batch=max_batch, seed=trial, cuda_graphs=masked)
        eng = Engine(target, config, drafters(target)["combined"](), depth)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = eng.generate(reqs)
        outs.append([(r.token_ids, r.finish_reason, r.spec.accepted_tokens) for r in res])
    assert outs[0] == outs[1], (max_batch, k)
