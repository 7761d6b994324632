"""The agents' relay pace and an idle proxy's: workers stay inside the lease timeout."""

from __future__ import annotations

import pytest

from tangram._core._beats import idle_wait, relay_wait


def test_at_the_defaults_an_agent_polls_every_three_seconds() -> None:
    assert relay_wait(1.0, 10.0) == 3.0


def test_a_tight_timeout_keeps_twice_a_heartbeat() -> None:
    assert relay_wait(1.0, 2.0) == 0.5
    assert relay_wait(0.2, 1.0) == pytest.approx(0.8 / 3)


@pytest.mark.parametrize("heartbeat", [0.05, 0.2, 1.0, 3.0])
@pytest.mark.parametrize("ratio", [2.0, 2.5, 4.0, 10.0, 100.0])
def test_a_relayed_beat_lands_before_the_timeout_with_half_a_heartbeat_to_spare(
    heartbeat: float, ratio: float
) -> None:
    timeout = ratio * heartbeat
    wait = relay_wait(heartbeat, timeout)
    # A worker beats once a heartbeat; the agent passes it on within its wait.
    latest = heartbeat + wait
    assert timeout - latest >= heartbeat / 2 - 1e-12
    assert wait >= heartbeat / 2  # never busier than before


@pytest.mark.parametrize("heartbeat", [0.05, 0.2, 1.0, 3.0])
@pytest.mark.parametrize("ratio", [2.0, 2.5, 4.0, 10.0, 100.0])
def test_a_proxy_holding_nothing_polls_at_the_relay_pace_but_never_faster_than_a_heartbeat(
    heartbeat: float, ratio: float
) -> None:
    timeout = ratio * heartbeat
    wait = idle_wait(heartbeat, timeout)
    assert wait >= heartbeat
    assert wait >= relay_wait(heartbeat, timeout)
    # It still lands its own beat before the timeout, with half a heartbeat to spare.
    assert timeout - wait >= heartbeat / 2 - 1e-12
