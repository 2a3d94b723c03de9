"""The engine emits the tokens it emitted before issue 59's redesign of its step: for the
same seeds, every drafter, slot counts from 1 to 8 for 12 requests (rows compacted and
admitted mid-call), a fixed depth and one switching speculation on and off. The digests
were recorded at commit d82c476 (`benchmarks/same_tokens.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.host_syncs import model
from benchmarks.same_tokens import KINDS, SLOTS, digests

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "engine_tokens.json").read_text())
SEEDS = 6


@pytest.fixture(scope="module")
def target():
    """The tiny target, where plain decoding rounds as where the digests were recorded."""
    target = model()
    plain = digests("plain", 0, target)
    if any(RECORDED[k] != v for k, v in plain.items()):
        pytest.skip("plain decoding rounds differently on this CPU than where recorded")
    return target


def _check(kind: str, seeds: range, target, slots=SLOTS) -> None:
    for seed in seeds:
        if seed:  # (seed 0's plain decoding: the fixture's)
            plain = digests("plain", seed, target)
            assert all(RECORDED[k] == v for k, v in plain.items()), seed
        got = digests(kind, seed, target, slots)
        bad = sorted(k for k, v in got.items() if RECORDED[k] != v)
        assert not bad, bad


@pytest.mark.parametrize("kind", KINDS[1:])
def test_every_drafter_emits_the_tokens_it_emitted_before(kind, target):
    _check(kind, range(1), target, (3, 8))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS[1:])
def test_every_drafter_emits_the_tokens_it_emitted_before_over_more_seeds(kind, target):
    _check(kind, range(1, SEEDS), target)
    _check(kind, range(1), target, (1, 5))


@pytest.mark.parametrize("kind", ["history", "combined"])
def test_trees_walked_as_on_an_accelerator_emit_the_same_tokens(kind, target, monkeypatch):
    """Masked walks, and the combined drafter's tree chosen on the device
    (`drafters.merged_tree`): the tokens the host-paced walk emitted."""
    from specroll import device

    monkeypatch.setattr(device, "HOST_PACED", ())
    _check(kind, range(1), target, (3, 8))
