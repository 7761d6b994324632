"""One shared scheduler for many rollout processes and hosts, on Ray.

``pip install tangram[ray]``. The driver creates the scheduler, a :class:`tangram.Runtime`
inside a named Ray actor; every worker process connects to it by name and uses
``tangram.acquire`` as usual::

    # driver
    async with tangram.ray.connect(name="tangram", capacity={"cpu": 64, "search": "50/s"}):
        ...  # start the rollout workers (Ray tasks or actors of this job)

    # in each worker
    async with tangram.ray.connect(name="tangram"):
        async with tangram.acquire(cpu=tangram.Elastic(1, 8), kind="run_tests"):
            ...

Grants held by a worker are heartbeated; a dead worker's units come back within the
heartbeat timeout. Host agents (:func:`start_agent`) pinned to nodes own those nodes'
sandboxes and GPUs: ``remote.sandbox(trajectory)`` places a trajectory on one of them,
and ``remote.service(name)`` a GPU model service call on one that serves it. See
docs/ray.md for deployment and failure semantics. Importing this module imports Ray;
importing ``tangram`` does not, and neither imports torch.
"""

from __future__ import annotations

from ._core._exports import publish as _publish
from ._shared._agent import HostAgent as HostAgent
from ._shared._agent import start_agent as start_agent
from ._shared._connect import connect as connect
from ._shared._hosts import RemoteSandbox as RemoteSandbox
from ._shared._hosts import RemoteService as RemoteService
from ._shared._protocol import DEFAULT_HEARTBEAT as DEFAULT_HEARTBEAT
from ._shared._protocol import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from ._shared._proxy import RemoteAcquireContext as RemoteAcquireContext
from ._shared._proxy import RemoteLease as RemoteLease
from ._shared._proxy import RemoteRuntime as RemoteRuntime
from ._shared._proxy import attach as attach
from .errors import SchedulerUnavailableError as SchedulerUnavailableError

__all__ = [
    "DEFAULT_HEARTBEAT",
    "DEFAULT_TIMEOUT",
    "HostAgent",
    "RemoteAcquireContext",
    "RemoteLease",
    "RemoteRuntime",
    "RemoteSandbox",
    "RemoteService",
    "SchedulerUnavailableError",
    "attach",
    "connect",
    "start_agent",
]

_publish("tangram.ray", globals())
