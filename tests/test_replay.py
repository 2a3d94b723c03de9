"""The CPU's capture and replay (`engine.replay`): a captured step replays its recorded
operations without its Python, as a CUDA graph does, so a host value frozen at capture
time is stale at replay here too, and the CPU tests hold the GPU path to its capture."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from benchmarks.host_syncs import drafters, model, requests
from specroll.engine import graphs
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.replay import CaptureError, record
from specroll.engine.slots import Slots


def test_a_replay_reads_its_buffers_anew_and_keeps_host_values_as_captured():
    buf, out = torch.zeros(4), torch.zeros(4)
    host = {"n": 2}

    def step():  # a buffer read (right) and a host value (frozen at capture)
        out.copy_(buf * 2 + host["n"])
        return (buf + 1).sum()

    replay = record(step)
    buf.fill_(5.0)
    host["n"] = 7
    total = replay()
    assert out.tolist() == [12.0] * 4  # 5 * 2 + the captured 2, not 7
    assert total.item() == 24.0 and total is replay()  # the same output tensor, refilled


@pytest.mark.parametrize(
    "read", [lambda t: t.item(), lambda t: t.tolist(), bool, int, lambda t: t.nonzero()]
)
def test_a_host_read_inside_a_capture_is_an_error(read):
    t = torch.ones(1)
    with pytest.raises(CaptureError, match="captured step"):
        record(lambda: read(t))


_sampling = Slots.sampling


def _planted(self: Slots, rows, span, hints=None):
    """The defect: the rows' temperatures from the host's list, a constant at capture."""
    slots = range(len(self.pos))[rows] if isinstance(rows, slice) else span
    got = _sampling(self, rows, span, hints)
    temps = [self.host.params[b][0] for b in slots]
    temperature = torch.tensor(temps, dtype=torch.float32, device=self.device)
    return dataclasses.replace(got, temperature=temperature)


def _tokens(name: str, graphs_on: bool) -> list[list[int]]:
    target = model()
    drafter = drafters(target)[name]()
    eng = Engine(
        target,
        EngineConfig(max_batch=5, seed=3, cuda_graphs=graphs_on),
        drafter,
        FixedDepth(k=3, max_batch=64),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [r.token_ids for r in eng.generate(requests(11))]


@pytest.fixture
def captured_on_cpu(monkeypatch):
    monkeypatch.setattr(graphs, "CAPTURE_ON", ("cuda", "cpu"))
    monkeypatch.setattr(graphs, "key_bucket", lambda need, max_len: need)
    monkeypatch.setattr(graphs, "bucket", lambda B, slots: B)


def test_a_step_that_bakes_in_a_host_value_fails_under_replay(captured_on_cpu, monkeypatch):
    """A planted defect (each row's temperature taken from a host list inside the step)
    passes eagerly and under the old stand-in that re-ran the step's Python; replayed,
    the caps of the capture stay, and the tokens change. The real step passes."""
    want = _tokens("draft_model", graphs_on=False)
    assert _tokens("draft_model", graphs_on=True) == want  # the real step
    monkeypatch.setattr(Slots, "sampling", _planted)
    assert _tokens("draft_model", graphs_on=False) == want  # eager: the defect is harmless
    assert _tokens("draft_model", graphs_on=True) != want  # replayed: caught
    rerun = lambda self, step: (step, None)  # noqa: E731  the stand-in before replay
    monkeypatch.setattr(graphs.Graphs, "_capture", rerun)
    assert _tokens("draft_model", graphs_on=True) == want  # ... which missed it


def test_new_weights_end_the_captures_that_hold_the_old_ones(captured_on_cpu):
    """Off CUDA, new weights are packed anew (`model.packed`): a step captured over the
    old packed weights would replay them. Loading weights ends the captures, so the next
    call emits what an engine that never captured emits with the new weights."""
    target, reqs = model(), requests(11)
    eng = Engine(target, EngineConfig(max_batch=5, seed=3, cuda_graphs=True))
    eng.generate(reqs)
    eng.generate(reqs)  # captured and replayed
    new = {n: p.detach() * 1.5 for n, p in target.named_parameters()}
    eng.load_weights(1, new)
    got = [r.token_ids for r in eng.generate(reqs)]
    fresh = Engine(model(), EngineConfig(max_batch=5, seed=3))
    fresh.load_weights(1, new)
    assert got == [r.token_ids for r in fresh.generate(reqs)]
    assert eng.stats.graphs > 0
