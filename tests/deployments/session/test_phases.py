"""The phase machine both the session's life and a group's phase are (deployments/session/phases.py)."""
import threading
from enum import Enum

import pytest

from deployments.session.phases import PhaseError, PhaseMachine


class Light(Enum):
    GREEN = "green"
    AMBER = "amber"
    RED = "red"
    OFF = "off"


TABLE = {Light.GREEN: {Light.AMBER, Light.OFF}, Light.AMBER: {Light.RED, Light.OFF}, Light.RED: {Light.OFF},
         Light.OFF: set()}


def test_moves_only_along_the_table_and_keeps_the_reason():
    m = PhaseMachine(Light.GREEN, TABLE)
    assert not m.move(Light.RED) and m.phase is Light.GREEN and m.why is None
    assert m.move(Light.AMBER, "timer") and (m.phase, m.why) == (Light.AMBER, "timer")
    with pytest.raises(PhaseError, match="the light: amber -> green is not a transition"):
        m.enter(Light.GREEN, "the light")
    m.enter(Light.OFF, "the light")
    assert m.phase is Light.OFF and m.why is None and not m.move(Light.OFF)


def test_the_table_names_every_phase():
    with pytest.raises(ValueError, match="the transitions of Light must list every phase"):
        PhaseMachine(Light.GREEN, {Light.GREEN: {Light.AMBER}})


def test_of_racing_moves_one_wins_with_its_reason():
    m = PhaseMachine(Light.GREEN, TABLE)
    go = threading.Barrier(8)
    won = []

    def switch_off(i):
        go.wait()
        if m.move(Light.OFF, f"thread {i}"):
            won.append(i)
    threads = [threading.Thread(target=switch_off, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and m.why == f"thread {won[0]}" and m.phase is Light.OFF
