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

from ._ray import DEFAULT_HEARTBEAT as DEFAULT_HEARTBEAT
from ._ray import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from ._ray import RemoteAcquireContext as RemoteAcquireContext
from ._ray import RemoteLease as RemoteLease
from ._ray import RemoteRuntime as RemoteRuntime
from ._ray import SchedulerUnavailableError as SchedulerUnavailableError
from ._ray import attach as attach
from ._ray import connect as connect
from ._ray_agent import HostAgent as HostAgent
from ._ray_agent import RemoteSandbox as RemoteSandbox
from ._ray_agent import RemoteService as RemoteService
from ._ray_agent import start_agent as start_agent

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

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("tangram._"):
        _obj.__module__ = "tangram.ray"
del _name, _obj
