"""The host book (``tangram/_shared/_placement.py``): which host a trajectory's sandbox
goes to, what each host counts, and what a dropped proxy leaves to close. Pure books, no
actor and no cluster."""

from __future__ import annotations

import pytest

from tangram._shared._placement import HostBook
from tangram.errors import InvalidSettingError, SchedulerUnavailableError, UnknownResourceError


def test_the_host_book_keeps_a_trajectory_on_the_least_loaded_host() -> None:
    book = HostBook()
    with pytest.raises(SchedulerUnavailableError, match="no host agent"):
        book.place("t0")
    gpu = {"resource": "gpu@b", "units": 1, "services": ["judge"], "resident": []}
    assert book.add("a", "cpu@a", 4, "agent-a", "cid-a", None) == {"cpu@a": 4}
    assert book.add("b", "cpu@b", 2, "agent-b", "cid-b", gpu) == {"cpu@b": 2, "gpu@b": 1}
    assert book.place("t1") == ("a", "agent-a")  # both empty: the first by name
    assert book.place("t2") == ("b", "agent-b")  # a has a sandbox per 4 cores, b none
    with pytest.raises(InvalidSettingError, match="already has an open sandbox"):
        book.place("t1")  # one block per trajectory: its first keeps its host and count
    assert book.describe()["a"]["placed"] == 1
    with pytest.raises(UnknownResourceError, match="no host agent serves 'other'") as caught:
        book.place_service("cid-w", "other")
    assert isinstance(caught.value, LookupError)  # as GpuPool.use for a name it lacks
    ticket, host, _ = book.place_service("cid-w", "judge")
    assert host == "b" and book.describe()["b"]["calls"] == 1
    # The worker's proxy is dropped: its service block ends; host b's agent is dropped
    # next, and its cores and devices leave the capacity.
    assert book.drop("cid-w") == {}
    assert book.describe()["b"]["calls"] == 0
    assert book.drop("cid-b") == {"cpu@b": 0, "gpu@b": 0}
    assert sorted(book.describe()) == ["a"]
    book.unplace_service(ticket, 1, ["judge"])  # a late end of the block changes nothing
    book.unplace("t1")
    assert book.describe()["a"]["placed"] == 0


def test_the_host_book_counts_the_sandboxes_an_agent_placed_itself() -> None:
    """Workers place sandboxes on their own node without the book; a host whose agent
    says it holds more per core is no longer the least loaded."""
    book = HostBook()
    book.add("a", "cpu@a", 2, "agent-a", "cid-a", None)
    book.add("b", "cpu@b", 2, "agent-b", "cid-b", None)
    book.note("a", 3)  # three opened on a by its own workers
    assert book.place("t1") == ("b", "agent-b")
    assert book.place("t2") == ("b", "agent-b")  # b at 1 per core, a at 1.5
    assert book.describe()["a"]["sandboxes"] == 3
    book.note("a", 0)  # they closed
    assert book.place("t3") == ("a", "agent-a")
    assert book.describe()["a"]["sandboxes"] == 1  # the book's own
    book.note("gone", 5)  # a host that left: nothing to count


def test_the_host_book_counts_open_blocks_on_a_host_that_comes_back() -> None:
    """A host dropped and added again (a replacement agent under its name) counts the
    sandboxes placed there that have not ended: each one's ``unplace`` will, so its
    load never goes below what the book placed."""
    book = HostBook()
    book.add("a", "cpu@a", 2, "agent-a", "cid-a", None)
    book.place("t1", "cid-w")
    book.place("t2", "cid-w")
    assert book.drop("cid-a") == {"cpu@a": 0}
    book.add("a", "cpu@a", 2, "agent-a", "cid-a", None)
    assert book.describe()["a"]["placed"] == 2
    book.unplace("t1")
    book.unplace("t2")
    assert book.describe()["a"]["placed"] == 0
    # So too the service blocks open there: the old agent's lapsed, or gone, or alive.
    book = HostBook()
    gpu = {"resource": "gpu@a", "units": 2, "services": ["s"], "resident": []}
    for leave in (book.lapse, book.drop, lambda cid: None):
        book.add("a", "cpu@a", 2, "agent-a", "cid-a", gpu)
        ticket, _, _ = book.place_service("cid-w", "s")
        leave("cid-a")
        book.add("a", "cpu@a", 2, "agent-a2", "cid-a2", gpu)
        assert book.describe()["a"]["calls"] == 1
        book.unplace_service(ticket, 0, [])
        assert book.describe()["a"]["calls"] == 0


def test_the_host_book_hands_back_the_sandboxes_of_a_dropped_proxy() -> None:
    book = HostBook()
    book.add("a", "cpu@a", 2, "agent-a", "cid-a", None)
    book.place("t1", "cid-w")
    book.place("t2", "cid-w")
    book.place("t3", "cid-v")
    assert book.agents() == {"cid-a": "agent-a"}
    # The worker's proxy went silent: its two sandboxes are to be closed on their agent,
    # and they no longer count on the host; the other worker's stays.
    assert sorted(book.orphans("cid-w")) == [("t1", "agent-a"), ("t2", "agent-a")]
    assert book.describe()["a"]["placed"] == 1
    assert book.orphans("cid-w") == []
    book.unplace("t3")  # closed by its owner: nothing left to hand back
    assert book.orphans("cid-v") == []
