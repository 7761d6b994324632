"""A policy of one's own that plans what breaks the ledger's rules gets a PolicyError.

Before the check, a greedy policy ran four one-core actions at once on one core without a
word, and a policy that raised from the runtime's timer cancelled the body of
``async with runtime`` and surfaced only as an ExceptionGroup at its exit.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest
from strategies import make_action

from tangram import Elastic, ElasticPolicy, Estimator, FcfsPolicy, Rate, Runtime, simulate
from tangram._core._ledger import Ledger, held_matches_grants
from tangram._core._policy import RUNNING, WAITING, Entry
from tangram._core._resources import parse_capacity
from tangram._sim._simulate import Step
from tangram.abc import Plan, State
from tangram.errors import PolicyError, RuntimeClosedError

pytestmark = pytest.mark.anyio

CAPACITY = {"cpu": 4, "api": Rate(2, burst=2)}


class Scripted:
    """Plans as tangram does until ``bad`` is set, then returns what ``bad`` builds."""

    def __init__(self) -> None:
        self.inner = ElasticPolicy()
        self.bad: Callable[[State], object] | None = None

    def plan(self, state: State) -> Plan:
        if self.bad is not None:
            return self.bad(state)  # type: ignore[return-value]
        return self.inner.plan(state)


def _running_and_waiting() -> tuple[Ledger, Scripted, dict[str, Entry]]:
    """A ledger with a running rigid action, a running resizable one and two waiters."""
    policy = Scripted()
    ledger = Ledger(parse_capacity(CAPACITY), policy, Estimator())
    entries = {
        "rigid": ledger.submit(make_action({"cpu": 1}, CAPACITY), 0.0),
        "elastic": ledger.submit(
            make_action({"cpu": Elastic(1, 3, resizable=True)}, CAPACITY), 0.0
        ),
    }
    ledger.step(0.0)
    assert all(e.state == RUNNING for e in entries.values())
    assert ledger.free["cpu"] == 0  # the elastic one grew into the rest
    entries["waiting"] = ledger.submit(make_action({"cpu": 1}, CAPACITY), 1.0)
    entries["call"] = ledger.submit(make_action({"api": 1}, CAPACITY), 1.0)
    entries["wide"] = ledger.submit(make_action({"cpu": Elastic(1, 2)}, CAPACITY), 1.0)
    return ledger, policy, entries


def _snapshot(ledger: Ledger) -> tuple[object, ...]:
    return (
        dict(ledger.held),
        dict(ledger.tokens),
        [(e.seq, e.state, e.units) for e in ledger.running],
        [e.seq for e in ledger.waiting()],
    )


FAULTS: dict[str, Callable[[dict[str, Entry]], object]] = {
    "not a plan": lambda e: [(e["waiting"], 0)],
    "a line that is not a pair": lambda e: Plan(admits=[e["waiting"]]),  # type: ignore[list-item]
    "units that are not whole": lambda e: Plan(resizes=[(e["elastic"], 1.5)]),  # type: ignore[list-item]
    "units that are a bool": lambda e: Plan(resizes=[(e["elastic"], True)]),
    "a running action admitted": lambda e: Plan(admits=[(e["rigid"], 0)]),
    "one admitted twice": lambda e: Plan(
        resizes=[(e["elastic"], 1)], admits=[(e["waiting"], 0), (e["waiting"], 0)]
    ),
    "past the free units": lambda e: Plan(admits=[(e["waiting"], 0)]),
    "past the free units, elastic": lambda e: Plan(
        resizes=[(e["elastic"], 2)], admits=[(e["wide"], 2)]
    ),
    "below an elastic's range": lambda e: Plan(
        resizes=[(e["elastic"], 1)], admits=[(e["wide"], 0)]
    ),
    "above an elastic's range": lambda e: Plan(
        resizes=[(e["elastic"], 1)], admits=[(e["wide"], 3)]
    ),
    "a resize past the range": lambda e: Plan(resizes=[(e["elastic"], 4)]),
    "a resize of a rigid action": lambda e: Plan(resizes=[(e["rigid"], 2)]),
    "a resize of a waiting action": lambda e: Plan(resizes=[(e["wide"], 1)]),
    "one resized twice": lambda e: Plan(resizes=[(e["elastic"], 2), (e["elastic"], 1)]),
    "past a rate's tokens": lambda e: Plan(
        admits=[(e["call"], 0)] + [(e[f"call{i}"], 0) for i in (2, 3)]
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_is_refused_and_nothing_applied(fault: str) -> None:
    ledger, policy, entries = _running_and_waiting()
    for i in (2, 3):
        entries[f"call{i}"] = ledger.submit(make_action({"api": 1}, CAPACITY), 1.0)
    before = _snapshot(ledger)
    policy.bad = lambda state: FAULTS[fault](entries)
    with pytest.raises(PolicyError, match=r"^policy Scripted .*nothing of its plan was applied"):
        ledger.step(2.0)
    assert _snapshot(ledger) == before
    assert held_matches_grants(ledger)


def test_a_plan_within_the_rules_is_applied() -> None:
    """The check refuses the faults above, not what a correct plan does with the same entries:
    shrink the resizable to make room, admit into it, and spend the rate's tokens."""
    ledger, policy, entries = _running_and_waiting()
    policy.bad = lambda state: Plan(
        resizes=[(entries["elastic"], 1)],
        admits=[(entries["waiting"], 0), (entries["call"], 0), (entries["wide"], 1)],
    )
    ledger.step(2.0)
    assert [entries[k].state for k in ("waiting", "call", "wide")] == [RUNNING] * 3
    assert ledger.free["cpu"] == 0 and held_matches_grants(ledger)


def test_a_lowered_capacity_may_be_kept_but_not_given_more() -> None:
    """Held past a lowered capacity, a kind is given nothing more, and a plan that
    leaves it alone is fine."""
    ledger, policy, entries = _running_and_waiting()
    ledger.set_capacity(parse_capacity({**CAPACITY, "cpu": 2}), 2.0)
    policy.bad = lambda state: Plan(admits=[(entries["call"], 0)])
    ledger.step(3.0)
    assert entries["call"].state == RUNNING
    policy.bad = lambda state: Plan(admits=[(entries["waiting"], 0)])
    with pytest.raises(PolicyError, match="grants 1 more 'cpu'"):
        ledger.step(4.0)
    assert entries["waiting"].state == WAITING


class Greedy:
    """Admits everything waiting, whatever is free (the review's policy)."""

    def plan(self, state: State) -> Plan:
        return Plan(admits=[(entry, 0) for entry in state.waiting()])


class RaisesOnThird:
    def __init__(self) -> None:
        self.inner = ElasticPolicy()
        self.passes = 0

    def plan(self, state: State) -> Plan:
        self.passes += 1
        if self.passes >= 3:
            raise ZeroDivisionError("a bug in the policy")
        return self.inner.plan(state)


@pytest.mark.parametrize("policy", [Greedy, RaisesOnThird])
async def test_a_faulty_policy_stops_the_runtime_and_wakes_every_waiter(
    policy: type[Greedy] | type[RaisesOnThird],
) -> None:
    """Every waiter gets the PolicyError, the running action keeps its grant to the end,
    later acquires are RuntimeClosedError from it, and the body is not cancelled."""
    outcomes: list[object] = []

    async def one(runtime: Runtime, i: int) -> None:
        try:
            async with runtime.acquire(cpu=1):
                await anyio.sleep(0.05)
            outcomes.append(i)
        except (PolicyError, RuntimeClosedError) as exc:
            outcomes.append(exc)

    async with Runtime({"cpu": 1}, policy=policy()) as runtime:
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, runtime, i)
        # Greedy faults at the second acquire's own pass, so the later two find the
        # runtime closed; RaisesOnThird at the timer's pass after the first release,
        # with three waiting.
        faults = [o for o in outcomes if isinstance(o, PolicyError)]
        closed = [o for o in outcomes if isinstance(o, RuntimeClosedError)]
        ran = [o for o in outcomes if isinstance(o, int)]
        assert len(ran) == 1 and len(faults) + len(closed) == 3 and faults, outcomes
        assert all("nothing of its plan was applied" in str(f) for f in faults)
        assert all(isinstance(c.__cause__, PolicyError) for c in closed)
        if policy is RaisesOnThird:
            assert len(faults) == 3
            assert all(isinstance(f.__cause__, ZeroDivisionError) for f in faults)
        assert runtime.stats().resources["cpu"].held == 0
        assert runtime.stats().resources["cpu"].peak == 1
        with pytest.raises(RuntimeClosedError) as later:
            async with runtime.acquire(cpu=1):
                pass
        assert isinstance(later.value.__cause__, PolicyError)
        await anyio.lowlevel.checkpoint()  # the body carries on: nothing was cancelled


async def test_a_fault_in_the_callers_own_pass_is_its_error() -> None:
    """An uncontended acquire plans at the call: the fault is raised there."""
    policy = Scripted()
    async with Runtime({"cpu": 1}, policy=policy) as runtime:
        policy.bad = lambda state: Plan(admits=[(e, 0) for e in state.waiting()] * 2)
        with pytest.raises(PolicyError, match="which is not waiting for it"):
            async with runtime.acquire(cpu=1):
                pass
        policy.bad = lambda state: "admit all"
        with pytest.raises(RuntimeClosedError):
            async with runtime.acquire(cpu=1):
                pass


def test_the_simulator_raises_it_too() -> None:
    steps = {f"t{i}": [Step(demand={"cpu": 1}, seconds_at_1=1.0)] for i in range(3)}
    with pytest.raises(PolicyError, match="policy Greedy grants"):
        simulate(steps, {"cpu": 1}, policy=Greedy())


def test_only_tangrams_own_policies_go_unchecked() -> None:
    """The check costs about half a pass that admits 64 actions, so tangram's policies,
    whose rules the test suite holds, skip it; a user's subclass of one does not."""

    class Mine(ElasticPolicy):
        def plan(self, state: State) -> Plan:
            return Plan(admits=[(entry, 0) for entry in state.waiting()])

    steps = {f"t{i}": [Step(demand={"cpu": 1}, seconds_at_1=1.0)] for i in range(3)}
    with pytest.raises(PolicyError, match="policy Mine grants"):
        simulate(steps, {"cpu": 1}, policy=Mine())
    for policy in (ElasticPolicy(), FcfsPolicy()):
        assert Ledger(parse_capacity(CAPACITY), policy, Estimator())._check is None
