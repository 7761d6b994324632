"""The scheduler a checked config names, opened: this process's, the driver's or the job's.

:mod:`._config` reads and checks a file and opens nothing; this module turns its
:class:`~._config.Config` into a running scheduler (a :class:`tangram.Runtime`, a proxy on
a Ray actor, or a proxy on the job's scheduler process on this node), and
:mod:`._session` adds the pools beside it. The imports go one way, config, then this,
then the session, so reading a file never loads what opening one needs (Ray is imported
only for ``mode = "ray"`` or inside a Ray job).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio

from .._runtime._run import Runtime, _enter_current, _exit_current
from .._sim._record import record_trace
from ..errors import ConfigError, InvalidCapacityError
from ._config import Config

__all__ = ["check_shared", "in_ray", "open_scheduler", "open_shared"]


def in_ray() -> bool:
    """Whether this process is part of a Ray job (every verl and OpenRLHF worker is).

    Ray is looked at only if something imported it already: a process outside Ray never
    pays for importing it.
    """
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def check_shared(config: Config) -> None:
    """What shared mode refuses that a per-process scheduler allows.

    :raises ConfigError: ``record`` in shared mode (the scheduler is not this process's).
    """
    if config.mode == "shared" and config.record is not None:
        raise ConfigError(
            f"{config.source or 'tangram config'}: `record` needs a scheduler of this "
            "process's own (mode = 'local'); mode = 'shared' shares the job's"
        )


@contextlib.asynccontextmanager
async def open_scheduler(
    config: Config, *, capacity: Mapping[str, object] | None = None
) -> AsyncIterator[Any]:
    """The scheduler the config asks for, current while the block runs.

    ``mode = "local"``: a :class:`tangram.Runtime` of this process. ``mode = "ray"``: a
    proxy to the named scheduler actor (:func:`tangram.ray.connect`, imported only then, so
    a local config never imports Ray). ``mode = "shared"``: inside a Ray job, a proxy on
    the job's own scheduler actor (created by the first process that asks); outside Ray,
    a proxy on the job's scheduler process on this node (started by the first process
    that asks, :mod:`tangram._shared._node`).
    ``capacity`` adds resources known only at run time (a sandbox pool's cores, GPU
    memory, quota keys); the file's values win where both name a resource. With
    ``record``, the runtime is recorded (:func:`tangram.record_trace`) into a file of its
    own in that directory, written when the block ends, so a rollout run through the
    adapters can be replayed under ``tangram simulate`` without a code change.

    :raises ConfigError: the capacity is invalid once merged, or differs from the one the
        job's shared scheduler was created with.
    """
    merged = {**(capacity or {}), **config.capacity}
    if config.mode == "ray":
        from .. import ray as tangram_ray

        ray = config.ray
        async with tangram_ray.connect(
            name=ray.name,
            namespace=ray.namespace,
            address=ray.address,
            # Only a creator states a capacity: a worker looking the actor up would have
            # its own pools' sizes refused as a mismatch.
            capacity=merged if ray.create and merged else None,
            create=ray.create,
            detached=ray.detached,
            policy=config.policy.build() if config.policy is not None else None,
            heartbeat=ray.heartbeat,
            lease_timeout=ray.lease_timeout,
        ) as remote:
            yield remote
        return
    if config.mode == "shared":
        check_shared(config)
        async with open_shared(config, capacity=merged) as remote:
            yield remote
        return
    try:
        runtime = Runtime(
            merged, policy=config.policy.build() if config.policy is not None else None
        )
    except (InvalidCapacityError, TypeError) as exc:
        raise ConfigError(f"{config.source or 'tangram config'}: [capacity]: {exc}") from exc
    async with runtime:
        if config.record is None:
            yield runtime
            return
        path = await anyio.to_thread.run_sync(_trace_path, config.record)
        async with record_trace(runtime, path, name=path.stem):
            yield runtime


_traces = itertools.count(1)


def _trace_path(directory: str) -> Path:
    """A file of its own for each scheduler: several processes and loops share the directory."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"tangram-{os.getpid()}-{next(_traces)}.jsonl"


@contextlib.asynccontextmanager
async def open_shared(
    config: Config, *, capacity: Mapping[str, object], **agent: Any
) -> AsyncIterator[Any]:
    """A proxy on this job's scheduler, current while the block runs: the job's actor
    inside a Ray job (:func:`tangram._shared._on_ray.open_shared`), else the job's scheduler
    process on this node (:func:`tangram._shared._node.open_node`), which never imports Ray.

    ``agent`` (``backend``, ``warm``, ``timeout``, ``services``, ``devices``) starts this
    node's host agent too.

    :raises ConfigError: the capacity is invalid, or not the one the job's scheduler has.
    """
    where = config.source or "tangram config"
    if in_ray():
        from .._shared._on_ray import open_shared as open_job_scheduler

        on: dict[str, Any] = {}
    else:
        from .._shared._node import open_node as open_job_scheduler

        on = {"config": config.source}
    async with contextlib.AsyncExitStack() as stack:
        try:
            remote = await stack.enter_async_context(
                open_job_scheduler(
                    **on,
                    capacity=capacity,
                    policy=config.policy.build() if config.policy is not None else None,
                    agent=bool(agent),
                    heartbeat=config.ray.heartbeat,
                    lease_timeout=config.ray.lease_timeout,
                    **agent,
                )
            )
        except (InvalidCapacityError, TypeError) as exc:
            raise ConfigError(f"{where}: [capacity]: {exc}") from exc
        token = _enter_current(remote)
        try:
            yield remote
        finally:
            _exit_current(token)
