"""The host book: which host agent a trajectory's sandbox or a service block runs on.

Pure bookkeeping, kept by the scheduler actor next to its leases: hosts as their agents
registered them (cores as ``cpu@<agent>``, devices as ``gpu@<agent>``), where each open
trajectory lives, and the open ``remote.service`` blocks per host. It knows nothing of
leases or of the runtime; the actor applies the capacity changes it returns.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidSettingError, SchedulerUnavailableError, UnknownResourceError
from ._protocol import logger

__all__ = ["HostBook"]


class _Host:
    __slots__ = (
        "agent",
        "calls",
        "cid",
        "gpu_resource",
        "gpus",
        "lapsed",
        "name",
        "placed",
        "reported",
        "resident",
        "resource",
        "seen_seq",
        "services",
        "units",
    )

    def __init__(
        self,
        name: str,
        resource: str,
        units: int,
        agent: Any,
        cid: str,
        gpu: Mapping[str, Any] | None,
    ) -> None:
        self.name = name
        self.resource = resource
        self.units = units
        self.agent = agent
        self.cid = cid
        self.placed = 0  # sandboxes this book placed here, open now
        self.reported = 0  # sandboxes its workers opened there, as its agent last said
        self.gpu_resource: str | None = None if gpu is None else gpu["resource"]
        self.gpus: int = 0 if gpu is None else gpu["units"]
        self.services: frozenset[str] = frozenset(() if gpu is None else gpu["services"])
        self.resident: frozenset[str] = frozenset(() if gpu is None else gpu["resident"])
        self.seen_seq = 0  # the agent's residency report this copy is from
        self.calls = 0  # open ``remote.service`` blocks placed here
        self.lapsed = False  # its agent went silent while alive: nothing new goes here


class HostBook:
    """The registered hosts and what is placed on them."""

    def __init__(self) -> None:
        self._hosts: dict[str, _Host] = {}
        self._placements: dict[str, str] = {}
        self._owners: dict[str, str] = {}  # trajectory -> the proxy that opened its sandbox
        self._tickets = itertools.count(1)
        self._service_calls: dict[int, tuple[str, str]] = {}  # ticket -> (host, cid)

    def add(
        self,
        name: str,
        resource: str,
        units: int,
        agent: Any,
        cid: str,
        gpu: Mapping[str, Any] | None,
    ) -> dict[str, object]:
        """Register a host agent (whose proxy is ``cid``); returns the capacity it adds."""
        host = _Host(name, resource, units, agent, cid, gpu)
        # Blocks placed on a host of this name not yet ended (a replacement of an agent
        # dropped, lapsed or alive) count on it: each one's ``unplace`` will.
        host.placed = sum(1 for placed in self._placements.values() if placed == name)
        host.calls = sum(1 for placed, _ in self._service_calls.values() if placed == name)
        self._hosts[name] = host
        return self._capacity(host, 1)

    def drop(self, cid: str) -> dict[str, object]:
        """A proxy is gone: its service blocks end, its hosts leave; returns the capacity lost."""
        for ticket, (_, owner) in list(self._service_calls.items()):
            if owner == cid:
                self._end_service_call(ticket)
        gone: dict[str, object] = {}
        for host in [h for h in self._hosts.values() if h.cid == cid]:
            if not host.lapsed:  # a lapsed one said so when it lapsed
                logger.warning("host agent %r stopped answering; its capacity is now 0", host.name)
            del self._hosts[host.name]
            gone.update(self._capacity(host, 0))
        return gone

    def lapse(self, cid: str) -> dict[str, object]:
        """Proxy ``cid``'s agent went silent but may be alive: its hosts take nothing new.

        Unlike :meth:`drop`, each keeps its name, what is placed on it, and its open
        service blocks, so that the agent picks up where it was when it is heard again
        (:meth:`resume`), and what ends meanwhile is counted off where it was counted on.

        :returns: the capacity it lends no more (none where its name went to another).
        """
        gone: dict[str, object] = {}
        for host in self._hosts.values():
            if host.cid != cid:
                continue
            host.lapsed = True
            gone.update(self._capacity(host, 0))
        return gone

    def resume(self, cid: str) -> dict[str, object]:
        """Proxy ``cid``'s lapsed agent is heard again: returns the capacity it lends again."""
        back: dict[str, object] = {}
        for host in self._hosts.values():
            if host.cid == cid and host.lapsed:
                host.lapsed = False
                back.update(self._capacity(host, 1))
        return back

    @staticmethod
    def _capacity(host: _Host, share: int) -> dict[str, object]:
        """``host``'s kinds at ``share`` (0 or 1) of what it registered."""
        updates: dict[str, object] = {host.resource: host.units * share}
        if host.gpu_resource is not None:
            updates[host.gpu_resource] = host.gpus * share
        return updates

    def describe(self) -> dict[str, dict[str, Any]]:
        return {
            h.name: {
                "resource": h.resource,
                "units": h.units,
                "placed": h.placed,
                "sandboxes": h.placed + h.reported,
                "gpu_resource": h.gpu_resource,
                "gpus": h.gpus,
                "services": sorted(h.services),
                "resident": sorted(h.resident),
                "calls": h.calls,
                "lapsed": h.lapsed,
            }
            for h in self._hosts.values()
        }

    def agents(self) -> dict[str, Any]:
        """Every registered host agent's actor handle, by its proxy's id."""
        return {h.cid: h.agent for h in self._hosts.values()}

    def orphans(self, cid: str) -> list[tuple[str, Any]]:
        """Forget the sandboxes proxy ``cid`` opened: (trajectory, agent) for each to close.

        A worker that dies inside a sandbox's block never closes it; its agent would keep
        the sandbox, and any command still running in it, for as long as it lives.
        """
        found = []
        for trajectory, owner in list(self._owners.items()):
            if owner != cid:
                continue
            name = self._placements.get(trajectory)
            host = self._hosts.get(name) if name is not None else None
            self.unplace(trajectory)
            if host is not None:
                found.append((trajectory, host.agent))
        return found

    def place(self, trajectory: str, cid: str | None = None) -> tuple[str, Any]:
        """The host for ``trajectory``'s sandbox: the least loaded (sandboxes per core).

        Asked only for what a worker's own node does not take (see :meth:`note`).

        A trajectory's actions then all run on the host that keeps its files. ``cid`` is
        the proxy opening it, which owns it. One open sandbox per trajectory: a second
        block used to be sent to the same host, where the agent refused it, and its
        clean-up then closed the first block's sandbox and unplaced it twice.

        :raises SchedulerUnavailableError: no host agent is registered.
        :raises InvalidSettingError: ``trajectory`` has an open sandbox already.
        """
        name = self._placements.get(trajectory)
        if name is not None and name in self._hosts:
            raise InvalidSettingError(
                f"trajectory {trajectory!r} already has an open sandbox (on host {name!r}): "
                "one block per trajectory at a time"
            )
        serving = [h for h in self._hosts.values() if not h.lapsed]
        if not serving:
            raise SchedulerUnavailableError(
                "no host agent is registered with the scheduler"
                if not self._hosts
                else f"no host agent answers the scheduler now (lapsed: {sorted(self._hosts)})"
            )
        host = min(
            serving,
            key=lambda h: ((h.placed + h.reported) / max(h.units, 1), h.name),
        )
        host.placed += 1
        self._placements[trajectory] = host.name
        if cid is not None:
            self._owners[trajectory] = cid
        return host.name, host.agent

    def note(self, name: str, sandboxes: int, cid: str | None = None) -> None:
        """Host ``name``'s workers have ``sandboxes`` open there that this book did not place.

        Workers place their sandboxes on their own node's agent while it has a core per
        sandbox, without this book (``HostAgentActor.open_here``); their agent says how
        many when it reports or one of them spills here, and a host's load counts them
        beside the book's own. ``cid``: the agent's proxy, when the agent says so itself;
        an agent whose name another took since speaks for its own node, not this host.
        """
        host = self._hosts.get(name)
        if host is not None and (cid is None or host.cid == cid):
            host.reported = sandboxes

    def holder(self, name: str) -> str | None:
        """The proxy id of the agent registered as host ``name``, if one is."""
        host = self._hosts.get(name)
        return None if host is None else host.cid

    def agent(self, name: str) -> Any | None:
        """Host ``name``'s agent, if it is registered."""
        host = self._hosts.get(name)
        return None if host is None else host.agent

    def unplace(self, trajectory: str) -> None:
        self._owners.pop(trajectory, None)
        name = self._placements.pop(trajectory, None)
        host = self._hosts.get(name) if name is not None else None
        if host is not None:
            host.placed -= 1

    def place_service(self, cid: str, service: str) -> tuple[int, str, Any]:
        """The host for one ``remote.service(service)`` block, and its ticket.

        Mirrors the pool's own rule one level up: a host where the service is resident
        (no restore) wins while it has fewer open blocks than devices; once every such
        host is that busy, the least busy host that serves it, so calls spread over the
        cluster's devices instead of queueing on one.

        :raises UnknownResourceError: no registered host serves ``service`` (also a
            ``LookupError``), as ``GpuPool.use`` for a name it lacks.
        :raises SchedulerUnavailableError: every host that serves it has lapsed.
        """
        serving = [h for h in self._hosts.values() if service in h.services and h.gpus > 0]
        if serving and all(h.lapsed for h in serving):
            raise SchedulerUnavailableError(
                f"no host agent that serves {service!r} answers the scheduler now "
                f"(lapsed: {sorted(h.name for h in serving)})"
            )
        serving = [h for h in serving if not h.lapsed]
        if not serving:
            offered = sorted({s for h in self._hosts.values() for s in h.services})
            raise UnknownResourceError(
                f"no host agent serves {service!r} (served: {offered}): start one with "
                "tangram.ray.start_agent(..., services=[...])"
            )

        def key(h: _Host) -> tuple[bool, bool, float, str]:
            load = h.calls / h.gpus
            return (load >= 1, service not in h.resident, load, h.name)

        host = min(serving, key=key)
        host.calls += 1
        ticket = next(self._tickets)
        self._service_calls[ticket] = (host.name, cid)
        return ticket, host.name, host.agent

    def unplace_service(self, ticket: int, seq: int, resident: list[str]) -> None:
        """A service block ended; ``resident`` is its agent's residency as of report ``seq``."""
        name = self._end_service_call(ticket)
        host = self._hosts.get(name) if name is not None else None
        # Reports travel through workers, and calls to an async actor may overtake each
        # other: only a newer report than the one applied replaces it.
        if host is not None and seq > host.seen_seq:
            host.seen_seq = seq
            host.resident = frozenset(resident)

    def _end_service_call(self, ticket: int) -> str | None:
        entry = self._service_calls.pop(ticket, None)
        if entry is None:
            return None
        host = self._hosts.get(entry[0])
        if host is not None:
            host.calls -= 1
        return entry[0]
