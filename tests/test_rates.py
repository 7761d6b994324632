"""The book of a job's API rate lent to its nodes (pure: tangram/_shared/_rates.py).

The safety rule is checked against a model of the protocol's lags: each node applies an
answer only when it arrives, one ask in flight per node, and reports what it runs on in
its next ask; the job's actor applies its own share at once.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram._shared._rates import (
    _RESUM,
    GIVE_BACK_AFTER,
    HEADROOM,
    LEASE_AT,
    POOL,
    RateBook,
    _Sums,
    leases,
)

R, B, PERIOD = 100.0, 20.0, 1.0


class _Job:
    """The book with nodes that apply their answers late, as the protocol lets them."""

    def __init__(self, rate: float = R, burst: float = B) -> None:
        self.book = RateBook(rate, burst, PERIOD)
        self.running: dict[str, tuple[float, float]] = {}  # what each node grants from
        self.flight: dict[str, tuple[float, float]] = {}  # answers not yet arrived
        self.pool = (rate, burst)
        self.now = 0.0

    def ask(self, node: str, used: float, waiting: float = 0.0, largest: float = 1.0) -> None:
        if node in self.flight:
            return  # one ask in flight per node
        applied = self.running.get(node, (0.0, 0.0))
        self.flight[node] = self.book.ask(node, used, waiting, largest, applied, self.now)
        self.pool_want(0.0)

    def pool_want(self, used: float, waiting: float = 0.0, largest: float = 0.0) -> None:
        self.pool = self.book.pool(used, waiting, largest)

    def arrive(self, node: str) -> None:
        if node in self.flight:
            self.running[node] = self.flight.pop(node)

    def expire(self, node: str) -> None:
        """The node stops granting (its share's time ran out), then the actor drops it."""
        self.running.pop(node, None)
        self.flight.pop(node, None)
        self.book.drop(node)
        self.pool_want(0.0)

    def play(self, what: str, node: str, used: float, waiting: float, largest: float) -> None:
        """One drawn event: an ask, an answer arriving, a node expiring, the pool's want."""
        if what == "ask":
            self.ask(node, used, waiting, largest)
        elif what == "arrive":
            self.arrive(node)
        elif what == "expire":
            self.expire(node)
        else:
            self.pool_want(used, waiting, largest)

    def in_use(self) -> tuple[float, float]:
        rate = self.pool[0] + sum(r for r, _ in self.running.values())
        burst = self.pool[1] + sum(b for _, b in self.running.values())
        return rate, burst

    def settle(
        self,
        demand: dict[str, tuple[float, float]],
        pool: tuple[float, float] = (0.0, 0.0),
        rounds: int = 8,
    ) -> None:
        """Asks with fixed (used, waiting) per node until the shares settle."""
        for _ in range(rounds):
            for node, (used, waiting) in demand.items():
                self.ask(node, used, waiting)
                self.pool_want(*pool)
                self.arrive(node)
            self.now += 1.0


_events = st.lists(
    st.tuples(
        st.sampled_from(["ask", "arrive", "expire", "pool"]),
        st.sampled_from(["a", "b", "c", "d"]),
        st.floats(0.0, 400.0),
        st.floats(0.0, 400.0),
        st.floats(0.0, 30.0),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(_events)
def test_what_is_granted_from_never_passes_the_jobs_rate_or_burst(events: list) -> None:
    job = _Job()
    for event in events:
        job.play(*event)
        rate, burst = job.in_use()
        assert rate <= R + 1e-9 and burst <= B + 1e-9, (rate, burst)
        assert all(r >= 0 and b >= 0 for r, b in job.running.values())
        assert job.pool[0] >= 0 and job.pool[1] >= 0


def test_a_cut_frees_its_units_only_once_the_node_has_applied_it() -> None:
    job = _Job()
    job.settle({"a": (100.0, 300.0)})
    assert job.running["a"][0] == pytest.approx(R)  # alone and oversubscribed: all of it
    job.ask("a", 0.0)  # a's demand is gone: its share is cut, but not yet applied
    job.ask("b", 0.0, 300.0)
    assert job.flight["b"][0] == pytest.approx(0.0)  # a may still be granting at R
    job.arrive("a")
    job.arrive("b")
    job.ask("a", 0.0)  # a says it runs on nothing now
    job.ask("b", 0.0, 300.0)
    assert job.flight["b"][0] == pytest.approx(R)


def test_a_saturated_split_leaves_nodes_whose_calls_wait_alike_where_they_are() -> None:
    """One first-come-first-served line for the job makes every call wait alike: nodes
    whose calls do (mean queue / use, Little's law: 0.1 s on both) keep their parts."""
    job = _Job()
    job.settle({"a": (60.0, 6.0), "b": (40.0, 4.0)})
    assert job.running["a"][0] == pytest.approx(60.0, rel=0.01)
    assert job.running["b"][0] == pytest.approx(40.0, rel=0.01)
    assert job.in_use()[0] == pytest.approx(R)
    assert job.running["a"][1] == pytest.approx(B * 0.6, rel=0.01)


def test_a_saturated_split_moves_rate_to_the_node_whose_calls_wait_longer() -> None:
    job = _Job()
    job.settle({"a": (60.0, 3.0), "b": (40.0, 8.0)})  # waits of 0.05 s and 0.2 s
    assert job.running["b"][0] > 50.0 and job.running["a"][0] < 50.0
    assert job.in_use()[0] == pytest.approx(R)


def test_saturated_a_node_whose_calls_are_all_served_keeps_part_of_its_use() -> None:
    """In one line its calls would wait too: it gives up part of what it uses to the
    node whose calls wait, but keeps a share in proportion to its use (never nothing,
    which would make its calls wait a whole heartbeat)."""
    job = _Job()
    job.settle({"a": (30.0, 0.0), "b": (70.0, 50.0)})
    assert 10.0 < job.running["a"][0] < 30.0
    assert job.in_use()[0] == pytest.approx(R)


def _closed_loops(loops: tuple[int, ...], think: float, seconds: float) -> list[float]:
    """Calls a second each node served over the last third of ``seconds``: each node's
    ``loops`` call, wait for a token of the share their node runs on, and think.

    A model of the protocol's loop, with the book and nothing else real: every node
    asks each heartbeat (its use and its mean queue since its last ask, as
    ``NodeRates`` says them), a quarter heartbeat after an ask that raised its share
    1.5-fold while calls wait, and runs its answer from the next millisecond."""
    step, n = 0.001, len(loops)
    book = RateBook(R, B, PERIOD)
    share = [(0.0, 0.0)] * n
    tokens, queue = [0.0] * n, [float(k) for k in loops]
    back: list[list[float]] = [[] for _ in loops]  # when each thinking loop calls again
    asked, spent, waited = [0.0] * n, [0.0] * n, [0.0] * n
    due = [0.001 * i for i in range(n)]
    served = [0.0] * n
    for tick in range(int(seconds / step)):
        now = tick * step
        for i in range(n):
            if now >= due[i]:
                span = max(now - asked[i], step)
                answer = book.ask(str(i), spent[i] / span, waited[i] / span, 1.0, share[i], now)
                book.pool(0.0, 0.0, 0.0)
                ramp = answer[0] > 1.5 * share[i][0] and queue[i] > 0
                due[i] = now + (PERIOD / 4 if ramp else PERIOD)
                share[i], asked[i], spent[i], waited[i] = answer, now, 0.0, 0.0
                tokens[i] = min(tokens[i], answer[1])
            tokens[i] = min(share[i][1], tokens[i] + share[i][0] * step)
            queue[i] += sum(1 for at in back[i] if at <= now)
            back[i] = [at for at in back[i] if at > now]
            while queue[i] >= 1 and tokens[i] >= 1:
                tokens[i], queue[i], spent[i] = tokens[i] - 1, queue[i] - 1, spent[i] + 1
                back[i].append(now + think)
                if now >= 2 * seconds / 3:
                    served[i] += 1
            waited[i] += queue[i] * step
    return [count / (seconds / 3) for count in served]


@pytest.mark.parametrize(("loops", "think"), [((8, 4), 0.0), ((8, 4), 0.05), ((2, 6), 0.02)])
def test_saturated_closed_loops_are_served_as_one_line_would_serve_them(
    loops: tuple[int, int], think: float
) -> None:
    """Every loop at the same pace, so each node at its loops' part of the rate, and
    all of the rate served. Keeping a node whose calls were all served at its use (the
    rule before) served 8 loops thinking 50 ms 33 calls a second and 4 loops 55."""
    rates = _closed_loops(loops, think, seconds=30.0)
    assert sum(rates) >= 0.97 * R
    for rate, count in zip(rates, loops, strict=True):
        assert rate == pytest.approx(sum(rates) * count / sum(loops), rel=0.1)


def test_under_light_load_each_node_is_lent_room_to_grow_and_the_actor_keeps_the_rest() -> None:
    job = _Job()
    job.settle({"a": (10.0, 0.0), "b": (4.0, 1.0)})
    assert job.running["a"][0] == pytest.approx(HEADROOM * 10.0)
    assert job.running["b"][0] == pytest.approx(HEADROOM * 5.0)
    assert job.pool[0] == pytest.approx(R - HEADROOM * 15.0)


def test_a_node_that_wants_nothing_is_lent_nothing() -> None:
    job = _Job()
    job.settle({"a": (10.0, 0.0), "b": (0.0, 0.0)})
    assert job.running["b"] == (0.0, 0.0)


def test_the_jobs_own_callers_keep_their_part_of_the_split() -> None:
    """Calls that reach the job's actor (a worker with no agent) are a member too."""
    job = _Job()
    job.settle({"a": (75.0, 30.0)}, pool=(25.0, 10.0))
    assert job.pool[0] == pytest.approx(25.0, rel=0.02)
    assert job.running["a"][0] == pytest.approx(75.0, rel=0.02)


def test_a_burst_reaches_the_largest_waiting_call_when_the_job_burst_allows() -> None:
    job = _Job()
    for _ in range(4):
        job.ask("a", 10.0, 0.0, largest=15.0)
        job.arrive("a")
    burst = job.running["a"][1]
    assert burst == pytest.approx(15.0)  # not its rate's part of the burst, 20 * 20/100
    job.ask("b", 10.0, 0.0, largest=50.0)
    assert job.flight["b"][1] <= B - 15.0 + 1e-9  # never past the job's burst


def test_a_silent_node_is_named_and_its_share_comes_back_when_dropped() -> None:
    job = _Job()
    job.settle({"a": (50.0, 300.0), "b": (50.0, 300.0)})
    job.now += 10.0
    job.ask("b", 50.0, 300.0)
    assert job.book.silent(job.now, 5.0) == ["a"]
    job.expire("a")
    job.arrive("b")
    job.ask("b", 50.0, 300.0)
    assert job.flight["b"][0] == pytest.approx(R)
    assert list(job.book.nodes()) == ["b"] and POOL in job.book


@settings(max_examples=50, deadline=None)
@given(_events)
def test_the_sums_kept_as_members_change_are_the_sums_of_the_members(events: list) -> None:
    """An ask costs O(1), not a pass over a thousand nodes: the sums it reads are kept
    as members change, and must equal a fresh pass (a long run resums them too)."""
    job = _Job()
    for event in events * (1 + _RESUM // max(len(events), 1)):
        job.play(*event)
        fresh = _Sums()
        for name, member in job.book._members.items():
            fresh.add(member, name == POOL, PERIOD, 1.0)
        kept = job.book._sums
        for field in ("want", "waiting", "calm", "rate", "burst"):
            assert getattr(kept, field) == pytest.approx(getattr(fresh, field), abs=1e-6)


def test_no_node_holds_a_burst_another_nodes_largest_call_needs() -> None:
    """Two nodes whose calls are 6 of a burst of 10: both cannot hold 6 at once, so
    neither is raised past its part (5), and their calls of 6 go to the job's actor,
    whose own burst reaches them in turn. Raising one would starve the other for good."""
    job = _Job(rate=10.0, burst=10.0)
    for _ in range(6):
        for node in ("a", "b"):
            job.ask(node, 5.0, 12.0, largest=6.0)
            job.arrive(node)
    assert job.running["a"][1] == pytest.approx(5.0)
    assert job.running["b"][1] == pytest.approx(5.0)
    job.pool_want(0.0, 6.0, 6.0)
    assert job.book._target(job.book._members[POOL])[1] == pytest.approx(6.0)


def test_a_lone_nodes_burst_reaches_its_largest_call() -> None:
    job = _Job(rate=10.0, burst=10.0)
    for _ in range(4):
        job.ask("a", 1.0, 0.5, largest=6.0)
        job.arrive("a")
    assert job.running["a"][1] == pytest.approx(6.0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -5.0])
def test_an_ask_with_a_number_that_is_not_a_count_is_read_as_nothing(bad: float) -> None:
    job = _Job()
    job.settle({"a": (10.0, 0.0)})
    job.ask("b", bad, bad, bad)
    job.arrive("b")
    assert job.running["b"] == (0.0, 0.0)
    job.ask("a", 10.0)
    assert job.flight["a"][0] == pytest.approx(HEADROOM * 10.0)


@pytest.mark.parametrize("leasing", [False, True])
@pytest.mark.parametrize("gap", [0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0])
def test_a_node_leases_only_while_its_calls_outnumber_its_asks(leasing: bool, gap: float) -> None:
    """Calls ``gap`` heartbeats apart: a node starts leasing once LEASE_AT come within a
    heartbeat, and keeps its share until they span GIVE_BACK_AFTER heartbeats (about
    half a call a heartbeat, where an ask and a call sent to the job's actor cost it
    alike). Between the two, it stays as it is."""
    calls = [gap * PERIOD * i for i in range(LEASE_AT)]
    now = calls[-1]
    span = gap * (LEASE_AT - 1)
    expected = span <= (GIVE_BACK_AFTER if leasing else 1.0)
    assert leases(calls, now, PERIOD, leasing) is expected
    assert not leases(calls[1:], now, PERIOD, leasing)  # fewer calls than LEASE_AT
    # With no call since, a share is kept only so long.
    assert not leases(calls, calls[0] + (GIVE_BACK_AFTER + 0.01) * PERIOD, PERIOD, True)


@pytest.mark.parametrize("waiting", [False, True])
@pytest.mark.parametrize("quiet", [0.0, 0.5, 0.99, 1.0, 2.0])
def test_a_leasing_node_with_no_call_for_a_heartbeat_gives_its_share_back(
    waiting: bool, quiet: float
) -> None:
    """Four calls close together, then ``quiet`` heartbeats with none: a leasing node
    keeps its share for less than a heartbeat, or while a call still waits on it (the
    book would cut an unused share to nothing, and the next call would wait for it to
    grow again). A node not leasing is not started by the quiet."""
    calls = [0.1 * PERIOD * i for i in range(LEASE_AT)]
    now = calls[-1] + quiet * PERIOD
    assert leases(calls, now, PERIOD, True, waiting) is (waiting or quiet < 1.0)
    assert leases(calls, now, PERIOD, False, waiting) is (quiet * PERIOD + calls[-1] <= PERIOD)
