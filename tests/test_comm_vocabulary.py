"""One vocabulary for communication: the main job's ``--comm`` choices (and its --qwz
flags), ``CommConfig``'s names and ``--comm auto``'s candidates are the same set, each read
where it is used. A name planted in any one of them fails this test."""

from __future__ import annotations

import pytest

from examples.config import AUTO, TrainConfig, build_parser, comm_settings, weights_name
from fsdp_ext.comm import CommConfig, gradient_names, weight_names
from fsdp_ext.comm.auto import Layout, candidates

PROBES = ("default", "q8", "qwz", "qwz_forward", "int4", "fp8", "two_bit", "bf16_test")


def _accepted(part: str, names) -> set[str]:
    """The names ``CommConfig`` takes for ``part`` (``gradients`` or ``weights``)."""
    out = set()
    for name in names:
        try:
            CommConfig(**{part: name})
        except ValueError:
            continue
        out.add(name)
    return out


def test_comm_choices_presets_and_auto_candidates_name_the_same_set():
    comm = next(a for a in build_parser()._actions if a.dest == "comm")
    cli = set(comm.choices) - {AUTO}
    every = cli | set(gradient_names()) | set(PROBES)
    presets = _accepted("gradients", every)
    # a layout with nodes of several ranks, so every part of the choice is open
    auto = {c.gradients for c in candidates(Layout(world=4, node_size=2))}
    assert cli == presets == auto == set(gradient_names())
    assert "stock" in cli and {"q4", "loco"} <= cli


def test_weights_flags_presets_and_auto_candidates_name_the_same_set():
    flags = {
        weights_name(TrainConfig(qwz=qwz, qwz_forward_only=forward, verbose=False))
        for qwz in (False, True)
        for forward in (False, True)
    }
    every = flags | set(weight_names()) | set(PROBES)
    presets = _accepted("weights", every)
    auto = {c.weights for c in candidates(Layout(world=4, node_size=2))}
    assert flags == presets == auto == set(weight_names())


@pytest.mark.parametrize("comm", sorted(set(gradient_names())))
def test_each_comm_choice_is_the_preset_of_its_name(comm):
    """--comm NAME hands on exactly ``CommConfig(gradients=NAME)`` at the codec's group size."""
    settings = comm_settings(TrainConfig(comm=comm, verbose=False), 1)
    assert settings.gradients == CommConfig(gradients=comm).gradients
