"""The drafter registry takes apart what it assembles: a run's drafter's history store and
the drafters made of its parts (what a rollout backend's shadow drafters draft with)."""

from __future__ import annotations

import re

import pytest

from specroll.drafters.history import HistoryDrafter
from specroll.drafting import registry
from tests.conftest import _eagle3, spec_model


@pytest.fixture(scope="module")
def network():
    return _eagle3(spec_model(0))


def test_history_of_is_the_store_the_drafter_was_assembled_with(network):
    history = HistoryDrafter()
    assert registry.history_of(registry.assemble("history+eagle3", history, network)) is history
    assert registry.history_of(registry.assemble("history", history, None)) is history
    assert registry.history_of(registry.assemble("eagle3", None, network)) is None
    assert registry.history_of(None) is None


def test_part_of_shares_the_drafters_parts(network):
    history = HistoryDrafter()
    combined = registry.assemble("history+eagle3", history, network)
    assert registry.part_of(combined, "history+eagle3") is combined
    assert registry.part_of(combined, "history") is history
    alone = registry.part_of(combined, "eagle3")
    assert alone.name == "eagle3" and alone.network is network


@pytest.mark.parametrize(
    ("built", "name"),
    [
        ("eagle3", "history"),  # a shadow drafting from history needs the run's store
        ("eagle3", "history+eagle3"),
        ("history", "eagle3"),
        ("history", "history+eagle3"),
    ],
)
def test_a_part_the_drafter_lacks_is_refused(network, built, name):
    drafter = registry.assemble(built, HistoryDrafter(), network)
    refusal = f"{name} cannot be made of the run's drafter '{built}'"
    with pytest.raises(ValueError, match=re.escape(refusal)):
        registry.part_of(drafter, name)
