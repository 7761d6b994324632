"""Every public constructor and call, fed bad input: each fails at the call with a tangram
error that names the value (wrong types on purpose, so the table is not type-checked).

One row per call: (id, the call, the error it raises, a fragment of the message that
names the value). A value of the wrong type must raise a TypeError and a ValueError (the
tangram leaves for it subclass both, as these calls raised ValueError before), one out of
range a ValueError that is not a TypeError: ``except TypeError`` tells the two apart.
Where each error sits in the tree is ``tests/test_errors.py``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import pytest
import torch

import tangram
import tangram.gpu as gpu
import tangram.metrics as metrics
import tangram.quota as quota
import tangram.testing as testing
from tangram import errors

_KEY = quota.ApiKey(name="k", requests=10)


def _in_runtime(call: Callable[[], AbstractAsyncContextManager[object]]) -> Callable[[], None]:
    """Enter ``call()`` inside a running runtime of 4 cores and 16 GiB."""

    async def main() -> None:
        async with tangram.Runtime({"cpu": 4, "mem": "16GiB"}), call():
            pass

    return lambda: anyio.run(main)


def _in_sandbox(act: Callable[[tangram.Sandbox], Awaitable[object]]) -> Callable[[], None]:
    """Run ``act(sandbox)`` on a real pool over in-memory sandboxes."""

    async def main() -> None:
        async with testing.memory_sandboxes() as pool, pool.sandbox("t") as sandbox:
            await act(sandbox)

    return lambda: anyio.run(main)


def _backend_class(name: object) -> object:
    """Where a backend name is looked up (a sandbox pool's ``backend`` by name)."""
    from tangram._sandbox._backend import backend_class

    return backend_class(name)


def _ray() -> Any:
    """``tangram.ray``, skipped where Ray is not installed (never under CI, as test_ray)."""
    if not os.environ.get("CI"):
        pytest.importorskip("ray")
    import tangram.ray

    return tangram.ray


def _remote() -> Any:
    """A proxy as ``tangram.ray.connect`` hands out, on no actor and no cluster.

    Its calls check their arguments before any Ray call (demands against the capacity it
    was given), so no cluster is started for these rows.
    """
    return _ray().RemoteRuntime(None, heartbeat=1.0, capacity={"cpu": 4})


def _connect(**settings: object) -> Callable[[], None]:
    """Enter ``tangram.ray.connect(**settings)`` on asyncio: refused before Ray starts."""

    async def main() -> None:
        async with _ray().connect(**settings):
            raise AssertionError("connected: the settings were not refused")

    return lambda: anyio.run(main)  # asyncio, anyio.run's default: connect refuses trio


def _on_asyncio(call: Callable[..., Awaitable[object]], *args: Any, **kwargs: Any) -> object:
    """``await call(*args, **kwargs)`` on a fresh asyncio loop."""
    return anyio.run(functools.partial(call, *args, **kwargs))


def _start_agent(**kwargs: object) -> Callable[[], object]:
    """``tangram.ray.start_agent`` on a proxy with no actor: refused before the Ray call."""
    return lambda: _on_asyncio(_ray().start_agent, _remote(), **kwargs)


def _step(**changes: object) -> tangram.Step:
    return tangram.Step(**{"demand": {"cpu": 1}, "seconds_at_1": 1.0, **changes})


def _tool(name: str) -> Callable[..., object]:
    """A class or function of the simulator or the tools that users reach through the CLI."""
    from tangram._sim import _baselines, _generate, _residency
    from tangram._tools import _bench_workload

    for module in (_baselines, _generate, _residency, _bench_workload):
        if hasattr(module, name):
            found: Callable[..., object] = getattr(module, name)
            return found
    raise AssertionError(name)


_CALLS: list[tuple[str, Callable[[], object], type[errors.TangramError], str]] = [
    # tangram.Runtime and its calls
    ("Runtime('cpu')", lambda: tangram.Runtime("cpu"), errors.InvalidCapacityError, "'cpu'"),
    ("Runtime cpu=-1", lambda: tangram.Runtime({"cpu": -1}), errors.InvalidCapacityError, "-1"),
    (
        "Runtime mem=lots",
        lambda: tangram.Runtime({"mem": "lots"}),
        errors.InvalidCapacityError,
        "'lots'",
    ),
    ("Runtime {}", lambda: tangram.Runtime({}), errors.InvalidCapacityError, "at least one"),
    (
        "Runtime estimator=3",
        lambda: tangram.Runtime({"cpu": 4}, estimator=3),
        errors.SettingTypeError,
        "3",
    ),
    (
        "Runtime policy=3",
        lambda: tangram.Runtime({"cpu": 4}, policy=3),
        errors.SettingTypeError,
        "3",
    ),
    (
        "set_capacity cpu=-1",
        lambda: tangram.Runtime({"cpu": 1}).set_capacity(cpu=-1),
        errors.InvalidCapacityError,
        "-1",
    ),
    (
        "add_instrument 3",
        lambda: tangram.Runtime({"cpu": 1}).add_instrument(3),
        errors.SettingTypeError,
        "3",
    ),
    # tangram.acquire
    (
        "acquire cpu=-1",
        _in_runtime(lambda: tangram.acquire(cpu=-1)),
        errors.InvalidDemandError,
        "-1",
    ),
    (
        "acquire cpu='x'",
        _in_runtime(lambda: tangram.acquire(cpu="x")),
        errors.DemandTypeError,
        "'cpu'",
    ),
    (
        "acquire gpu=1",
        _in_runtime(lambda: tangram.acquire(gpu=1)),
        errors.UnknownResourceError,
        "'gpu'",
    ),
    (
        "acquire cpu=8",
        _in_runtime(lambda: tangram.acquire(cpu=8)),
        errors.CapacityExceededError,
        "8",
    ),
    (
        "acquire mem=32GiB",
        _in_runtime(lambda: tangram.acquire(mem=32 * 2**30)),
        errors.CapacityExceededError,
        "32GiB",
    ),
    (
        "acquire wait=-1",
        _in_runtime(lambda: tangram.acquire(cpu=1, wait_timeout=-1)),
        errors.InvalidDemandError,
        "-1",
    ),
    (
        "acquire estimate='x'",
        _in_runtime(lambda: tangram.acquire(cpu=1, estimate="x")),
        errors.DemandTypeError,
        "'x'",
    ),
    (
        "acquire kind=3",
        _in_runtime(lambda: tangram.acquire(cpu=1, kind=3)),
        errors.DemandTypeError,
        "3",
    ),
    ("acquire(3)", _in_runtime(lambda: tangram.acquire(3)), errors.DemandTypeError, "3"),
    # demands, rates, efficiency models, policies
    ("Elastic(3, 2)", lambda: tangram.Elastic(3, 2), errors.InvalidDemandError, "2 < 3"),
    ("Elastic(0, 2)", lambda: tangram.Elastic(0, 2), errors.InvalidDemandError, "0"),
    ("Elastic(1, 'x')", lambda: tangram.Elastic(1, "x"), errors.DemandTypeError, "'x'"),
    (
        "Elastic efficiency=3",
        lambda: tangram.Elastic(1, 2, efficiency=3),
        errors.DemandTypeError,
        "3",
    ),
    (
        "Elastic resizable=1",
        lambda: tangram.Elastic(1, 2, resizable=1),
        errors.DemandTypeError,
        "1",
    ),
    ("Rate(-1)", lambda: tangram.Rate(-1), errors.InvalidCapacityError, "-1"),
    ("Rate(1, burst=0)", lambda: tangram.Rate(1, burst=0), errors.InvalidCapacityError, "0"),
    ("Amdahl(2)", lambda: tangram.Amdahl(2), errors.InvalidDemandError, "2"),
    ("Amdahl('x')", lambda: tangram.Amdahl("x"), errors.DemandTypeError, "'x'"),
    ("Power(-1)", lambda: tangram.Power(-1), errors.InvalidDemandError, "-1"),
    ("SpeedupTable({})", lambda: tangram.SpeedupTable({}), errors.DemandTypeError, "{}"),
    ("FcfsPolicy(dop=0)", lambda: tangram.FcfsPolicy(dop=0), errors.InvalidSettingError, "0"),
    ("FcfsPolicy(dop='4')", lambda: tangram.FcfsPolicy(dop="4"), errors.SettingTypeError, "'4'"),
    # CPU sandboxes
    ("SandboxPool(3)", lambda: tangram.SandboxPool(3), errors.SettingTypeError, "3"),
    ("SandboxPool warm=-1", lambda: tangram.SandboxPool(warm=-1), errors.InvalidSettingError, "-1"),
    ("SandboxPool warm=1.5", lambda: tangram.SandboxPool(warm=1.5), errors.SettingTypeError, "1.5"),
    (
        "SandboxPool timeout=0",
        lambda: tangram.SandboxPool(timeout=0),
        errors.InvalidSettingError,
        "0",
    ),
    ("SandboxPool kind=3", lambda: tangram.SandboxPool(kind=3), errors.SettingTypeError, "3"),
    ("backend 'podman'", lambda: _backend_class("podman"), errors.UnknownBackendError, "'podman'"),
    ("backend 3", lambda: _backend_class(3), errors.SettingTypeError, "3"),
    ("run no command", _in_sandbox(lambda s: s.run()), errors.SettingTypeError, "command=None"),
    ("run command=3", _in_sandbox(lambda s: s.run(3)), errors.SettingTypeError, "3"),
    ("run cpu='2'", _in_sandbox(lambda s: s.run("true", cpu="2")), errors.DemandTypeError, "'2'"),
    (
        "run timeout=0",
        _in_sandbox(lambda s: s.run("true", timeout=0)),
        errors.InvalidSettingError,
        "0",
    ),
    ("run NUL", _in_sandbox(lambda s: s.run("a\0b")), errors.InvalidSettingError, "NUL"),
    # A lone surrogate (JSON's "\ud800") raised a bare UnicodeEncodeError from the spawn,
    # after the cores were granted (a review of the adapters): each way text reaches it.
    *(
        (f"run {name} surrogate", _in_sandbox(call), errors.InvalidSettingError, "surrogate")
        for name, call in [
            ("code", lambda s: s.run(code="print('\ud800')")),
            ("command", lambda s: s.run("echo \ud800")),
            ("argv", lambda s: s.run(["echo", "\ud800"])),
            ("env", lambda s: s.run("true", env={"A": "\ud800"})),
            ("stdin", lambda s: s.run("cat", stdin="\ud800")),
            ("put", lambda s: s.put("x", "\ud800")),
        ]
    ),
    ("run env 3", _in_sandbox(lambda s: s.run("true", env={"A": 3})), errors.SettingTypeError, "3"),
    ("put ../x", _in_sandbox(lambda s: s.put("../x", b"")), errors.InvalidSettingError, "'../x'"),
    ("get 3", _in_sandbox(lambda s: s.get(3)), errors.SettingTypeError, "3"),
    (
        "LocalBackend processes=0",
        lambda: tangram.LocalBackend(processes=0),
        errors.InvalidSettingError,
        "0",
    ),
    (
        "LocalBackend memory=lots",
        lambda: tangram.LocalBackend(memory="lots"),
        errors.InvalidSettingError,
        "'lots'",
    ),
    (
        "LocalBackend memory=[1]",
        lambda: tangram.LocalBackend(memory=[1]),
        errors.SettingTypeError,
        "[1]",
    ),
    (
        "LocalBackend memory=-1",
        lambda: tangram.LocalBackend(memory=-1),
        errors.InvalidSettingError,
        "-1",
    ),
    (
        "LocalBackend uids",
        lambda: tangram.LocalBackend(uids=range(0)),
        errors.InvalidSettingError,
        "range(0, 0)",
    ),
    (
        "LocalBackend cores=[]",
        lambda: tangram.LocalBackend(cores=[]),
        errors.InvalidSettingError,
        "[]",
    ),
    (
        "LocalBackend open_files=8",
        lambda: tangram.LocalBackend(open_files=8),
        errors.InvalidSettingError,
        "8",
    ),
    (
        "LocalBackend max_file=0",
        lambda: tangram.LocalBackend(max_file=0),
        errors.InvalidSettingError,
        "0",
    ),
    (
        "LocalBackend user=3.5",
        lambda: tangram.LocalBackend(user=3.5),
        errors.SettingTypeError,
        "3.5",
    ),
    (
        "LocalBackend user=?",
        lambda: tangram.LocalBackend(user="no such user"),
        errors.InvalidSettingError,
        "'no such user'",
    ),
    (
        "DockerConfig memory=lots",
        lambda: tangram.DockerConfig(memory="lots"),
        errors.InvalidSettingError,
        "'lots'",
    ),
    (
        "DockerConfig work_size=-1",
        lambda: tangram.DockerConfig(work_size=-1),
        errors.InvalidSettingError,
        "-1",
    ),
    ("DockerConfig pids=0", lambda: tangram.DockerConfig(pids=0), errors.InvalidSettingError, "0"),
    (
        "DockerConfig user='0'",
        lambda: tangram.DockerConfig(user="0"),
        errors.InvalidSettingError,
        "'0'",
    ),
    ("DockerConfig user=3", lambda: tangram.DockerConfig(user=3), errors.SettingTypeError, "3"),
    (
        "DockerConfig api_timeout=0",
        lambda: tangram.DockerConfig(api_timeout=0),
        errors.InvalidSettingError,
        "0",
    ),
    (
        "DockerConfig sync_after=-1",
        lambda: tangram.DockerConfig(sync_after=-1),
        errors.InvalidSettingError,
        "-1",
    ),
    ("DockerConfig image=3", lambda: tangram.DockerConfig(image=3), errors.SettingTypeError, "3"),
    # GPU model services
    ("Device memory=-1", lambda: gpu.Device("d", memory=-1), errors.InvalidSettingError, "-1"),
    (
        "Device memory=lots",
        lambda: gpu.Device("d", memory="lots"),
        errors.InvalidCapacityError,
        "'lots'",
    ),
    ("Device name=3", lambda: gpu.Device(3, memory="1GiB"), errors.SettingTypeError, "3"),
    (
        "Device index=-1",
        lambda: gpu.Device("d", memory="1GiB", index=-1),
        errors.InvalidSettingError,
        "-1",
    ),
    ("GpuPool(3)", lambda: gpu.GpuPool(3), errors.SettingTypeError, "3"),
    ("GpuPool([])", lambda: gpu.GpuPool([]), errors.InvalidSettingError, "[]"),
    (
        "GpuPool devices=3",
        lambda: gpu.GpuPool([testing.MemoryModelService("m")], devices=3),
        errors.SettingTypeError,
        "3",
    ),
    ("TorchService factory=3", lambda: gpu.TorchService("m", 3), errors.SettingTypeError, "3"),
    (
        "TorchService headroom=-1",
        lambda: gpu.TorchService("m", torch.nn.Identity, headroom=-1),
        errors.InvalidSettingError,
        "-1",
    ),
    (
        "TorchService memory=lots",
        lambda: gpu.TorchService("m", torch.nn.Identity, memory="lots"),
        errors.InvalidCapacityError,
        "'lots'",
    ),
    (
        "TorchService max_replicas=0",
        lambda: gpu.TorchService("m", torch.nn.Identity, max_replicas=0),
        errors.InvalidSettingError,
        "0",
    ),
    (
        "TorchService split='x'",
        lambda: gpu.TorchService("m", torch.nn.Identity, split="x"),
        errors.InvalidSettingError,
        "'x'",
    ),
    (
        "VllmService servers=3",
        lambda: gpu.VllmService("m", 3, memory="1GiB"),
        errors.SettingTypeError,
        "3",
    ),
    (
        "discover_devices fraction=2",
        lambda: gpu.discover_devices(fraction=2),
        errors.InvalidSettingError,
        "2",
    ),
    # API quotas
    ("Quota('x')", lambda: quota.Quota("x"), errors.SettingTypeError, "'x'"),
    ("Quota([])", lambda: quota.Quota([]), errors.InvalidCapacityError, "[]"),
    (
        "Quota headroom='x'",
        lambda: quota.Quota([_KEY], headroom="x"),
        errors.SettingTypeError,
        "'x'",
    ),
    (
        "ApiKey requests=-1",
        lambda: quota.ApiKey(name="k", requests=-1),
        errors.InvalidCapacityError,
        "-1",
    ),
    (
        "ApiKey requests=[5]",
        lambda: quota.ApiKey(name="k", requests=[5]),
        errors.SettingTypeError,
        "[5]",
    ),
    ("Retry attempts=0", lambda: quota.Retry(attempts=0), errors.InvalidCapacityError, "0"),
    ("Adapt decrease=2", lambda: quota.Adapt(decrease=2), errors.InvalidCapacityError, "2"),
    ("Adapt decrease='x'", lambda: quota.Adapt(decrease="x"), errors.SettingTypeError, "'x'"),
    # traces and the simulator
    ("read_trace(3)", lambda: tangram.read_trace(3), errors.SettingTypeError, "3"),
    ("read_trace(['{'])", lambda: tangram.read_trace(["{"]), errors.TraceFormatError, "line 1"),
    (
        "simulate cpu=-1",
        lambda: tangram.simulate({}, {"cpu": -1}),
        errors.InvalidCapacityError,
        "-1",
    ),
    (
        "simulate demand",
        lambda: tangram.simulate({"t": [_step(demand={"cpu": -1})]}, {"cpu": 4}),
        errors.InvalidDemandError,
        "-1",
    ),
    ("Step seconds=-1", lambda: _step(seconds_at_1=-1), errors.InvalidSettingError, "-1"),
    ("Step efficiency=3", lambda: _step(efficiency=3), errors.DemandTypeError, "3"),
    ("simulate(3)", lambda: tangram.simulate(3, {"cpu": 4}), errors.SettingTypeError, "3"),
    (
        "simulate step 3",
        lambda: tangram.simulate({"t": [3]}, {"cpu": 4}),
        errors.SettingTypeError,
        "step 0 of 't'",
    ),
    (
        "simulate estimates='x'",
        lambda: tangram.simulate({}, {"cpu": 4}, estimates="x"),
        errors.InvalidSettingError,
        "'x'",
    ),
    (
        "simulate policy=3",
        lambda: tangram.simulate({}, {"cpu": 4}, policy=3),
        errors.SettingTypeError,
        "3",
    ),
    (
        "simulate estimator=3",
        lambda: tangram.simulate({}, {"cpu": 4}, estimator=3),
        errors.SettingTypeError,
        "3",
    ),
    (
        "simulate gpu_mem=-1",
        lambda: tangram.simulate({}, {"gpu": 1}, gpu_mem_gib_per_device=-1),
        errors.InvalidSettingError,
        "-1",
    ),
    (
        "simulate services, no gpu",
        lambda: tangram.simulate({}, {"cpu": 4}, services={}),
        errors.InvalidSettingError,
        "'cpu'",
    ),
    (
        "simulate unknown service",
        lambda: tangram.simulate(
            {"t": [_step(demand={"gpu": 1}, service="x")]}, {"gpu": 1}, services={}
        ),
        errors.InvalidSettingError,
        "'x'",
    ),
    ("TraceRecorder(3)", lambda: tangram.TraceRecorder(3), errors.SettingTypeError, "3"),
    (
        "TraceRecorder name=3",
        lambda: tangram.TraceRecorder(tangram.Runtime({"cpu": 1}), name=3),
        errors.SettingTypeError,
        "3",
    ),
    ("record_trace(3)", lambda: tangram.record_trace(3, "x"), errors.SettingTypeError, "3"),
    (
        "record_trace path=3",
        lambda: tangram.record_trace(tangram.Runtime({"cpu": 1}), 3),
        errors.SettingTypeError,
        "3",
    ),
    # the test kit
    ("InvariantChecker(3)", lambda: testing.InvariantChecker(3), errors.SettingTypeError, "3"),
    ("checker_of(3)", lambda: testing.checker_of(3), errors.SettingTypeError, "3"),
    ("check_idle(3)", lambda: testing.check_idle(3), errors.SettingTypeError, "3"),
    (
        "MemoryBackend cores=0",
        lambda: testing.MemoryBackend(cores=0),
        errors.InvalidSettingError,
        "0",
    ),
    (
        "MemoryBackend cores='4'",
        lambda: testing.MemoryBackend(cores="4"),
        errors.SettingTypeError,
        "'4'",
    ),
    ("MemoryBackend(3)", lambda: testing.MemoryBackend(3), errors.SettingTypeError, "3"),
    (
        "MemoryModelService fn=3",
        lambda: testing.MemoryModelService("m", 3),
        errors.SettingTypeError,
        "3",
    ),
    (
        "MemoryModelService memory=-1",
        lambda: testing.MemoryModelService("m", memory=-1),
        errors.InvalidSettingError,
        "-1",
    ),
    (
        "QuotaServer refuse_with=500",
        lambda: testing.QuotaServer(refuse_with=500),
        errors.InvalidSettingError,
        "500",
    ),
    (
        "QuotaServer latency=-1",
        lambda: testing.QuotaServer(latency=-1),
        errors.InvalidSettingError,
        "-1",
    ),
    ("Limit requests=-1", lambda: testing.Limit(requests=-1), errors.InvalidSettingError, "-1"),
    ("Limit concurrency=0", lambda: testing.Limit(concurrency=0), errors.InvalidSettingError, "0"),
    ("Limit requests='x'", lambda: testing.Limit(requests="x"), errors.SettingTypeError, "'x'"),
    # the benchmark and trace tools
    ("parse_policy('x')", lambda: _tool("parse_policy")("x"), errors.InvalidSettingError, "'x'"),
    (
        "parse_policy fixed-dop-0",
        lambda: _tool("parse_policy")("fixed-dop-0"),
        errors.InvalidSettingError,
        "'fixed-dop-0'",
    ),
    (
        "GenerateConfig workload='x'",
        lambda: _tool("GenerateConfig")(workload="x", batch=1),
        errors.InvalidSettingError,
        "'x'",
    ),
    (
        "GenerateConfig batch='x'",
        lambda: _tool("GenerateConfig")(workload="coding", batch="x"),
        errors.SettingTypeError,
        "'x'",
    ),
    (
        "GenerateConfig zipf=0",
        lambda: _tool("GenerateConfig")(workload="mopd", batch=1, zipf=0),
        errors.InvalidSettingError,
        "0",
    ),
    (
        "GenerateConfig zipf='x'",
        lambda: _tool("GenerateConfig")(workload="mopd", batch=1, zipf="x"),
        errors.SettingTypeError,
        "'x'",
    ),
    (
        "Residency too big",
        lambda: _tool("Residency")(
            1, 10.0, {"m": _tool("ServiceSpec")(name="m", gpu_mem_gib=20.0)}
        ),
        errors.InvalidSettingError,
        "20 GiB",
    ),
    (
        "Residency too many GPUs",
        lambda: _tool("Residency")(1, 80.0, {"m": _tool("ServiceSpec")(name="m", gpus=2)}),
        errors.InvalidSettingError,
        "2 GPUs",
    ),
    (
        "BenchConfig turns=0",
        lambda: _tool("BenchConfig")(trajectories=2, cores=1, turns=0),
        errors.InvalidSettingError,
        "0",
    ),
    (
        "BenchConfig cores='x'",
        lambda: _tool("BenchConfig")(trajectories=2, cores="x"),
        errors.SettingTypeError,
        "'x'",
    ),
    (
        "BenchConfig reward_models=1",
        lambda: _tool("BenchConfig")(trajectories=2, cores=1, reward_models=1),
        errors.InvalidSettingError,
        "1",
    ),
    (
        "BenchConfig time_scale=0",
        lambda: _tool("BenchConfig")(trajectories=2, cores=1, time_scale=0),
        errors.InvalidSettingError,
        "0",
    ),
    (
        "BenchConfig sandbox='x'",
        lambda: _tool("BenchConfig")(trajectories=2, cores=1, sandbox="x"),
        errors.InvalidSettingError,
        "'x'",
    ),
    # tangram.ray: checked before any Ray call, so no cluster starts
    ("ray connect name=3", _connect(name=3), errors.SettingTypeError, "3"),
    ("ray connect name=''", _connect(name=""), errors.SettingTypeError, "''"),
    ("ray connect heartbeat=0", _connect(heartbeat=0), errors.InvalidCapacityError, "(got 0)"),
    (
        "ray connect lease_timeout < 2 heartbeats",
        _connect(heartbeat=1.0, lease_timeout=1.5),
        errors.InvalidCapacityError,
        "1.5 < 2 x 1",
    ),
    (
        "ray connect cpu=-4",
        _connect(capacity={"cpu": -4}),
        errors.InvalidCapacityError,
        "-4",
    ),
    (
        "remote.acquire cpu='x'",
        lambda: _remote().acquire(cpu="x"),
        errors.DemandTypeError,
        "'x'",
    ),
    (
        "remote.acquire gpu=1",
        lambda: _remote().acquire(gpu=1),
        errors.UnknownResourceError,
        "'gpu'",
    ),
    ("remote.acquire cpu=8", lambda: _remote().acquire(cpu=8), errors.CapacityExceededError, "8"),
    (
        "remote.run fn=3",
        lambda: _on_asyncio(_remote().run, {"cpu": 1}, 3),
        errors.SettingTypeError,
        "3",
    ),
    (
        "remote.set_capacity(3)",
        lambda: _on_asyncio(_remote().set_capacity, 3),
        errors.InvalidCapacityError,
        "3",
    ),
    (
        "remote.set_capacity cpu=lots",
        lambda: _on_asyncio(_remote().set_capacity, cpu="lots"),
        errors.InvalidCapacityError,
        "'lots'",
    ),
    ("remote.sandbox(3)", lambda: _remote().sandbox(3), errors.SettingTypeError, "3"),
    ("remote.service(3)", lambda: _remote().service(3), errors.SettingTypeError, "3"),
    ("remote.service('')", lambda: _remote().service(""), errors.SettingTypeError, "''"),
    ("start_agent name=3", _start_agent(name=3), errors.SettingTypeError, "3"),
    ("start_agent name=''", _start_agent(name=""), errors.InvalidSettingError, "''"),
    ("start_agent name='a@b'", _start_agent(name="a@b"), errors.InvalidSettingError, "'a@b'"),
    (
        "start_agent services='judge'",
        _start_agent(name="a", services="judge"),
        errors.SettingTypeError,
        "'judge'",
    ),
    (
        "start_agent services=[3]",
        _start_agent(name="a", services=[3]),
        errors.SettingTypeError,
        "3",
    ),
    (
        "start_agent devices=['cpu:0']",
        _start_agent(name="a", services=[testing.MemoryModelService("m")], devices=["cpu:0"]),
        errors.SettingTypeError,
        "['cpu:0']",
    ),
    (
        "start_agent devices, no services",
        _start_agent(name="a", devices=[gpu.Device("cpu:0", memory="1GiB")]),
        errors.InvalidSettingError,
        "without `services`",
    ),
    # metrics
    ("Collector(3)", lambda: metrics.Collector(3), errors.SettingTypeError, "3"),
    (
        "Collector sandboxes=3",
        lambda: metrics.Collector(tangram.Runtime({"cpu": 1}), sandboxes=3),
        errors.SettingTypeError,
        "3",
    ),
    ("StepMetrics(3)", lambda: metrics.StepMetrics(3), errors.SettingTypeError, "3"),
    (
        "StepMetrics keys=3",
        lambda: metrics.StepMetrics(tangram.Runtime({"cpu": 1}), keys=3),
        errors.SettingTypeError,
        "3",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "fragment"), [pytest.param(c, e, f, id=i) for i, c, e, f in _CALLS]
)
def test_bad_input_to_a_public_call_raises_a_tangram_error_naming_it(
    call: Callable[[], object], error: type[errors.TangramError], fragment: str
) -> None:
    with pytest.raises(errors.TangramError) as caught:
        call()
    assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, TypeError) == issubclass(error, TypeError)
    assert fragment in str(caught.value)


def test_a_runtime_without_a_checker_is_a_lookup_of_ours() -> None:
    """Not a ValueError (the runtime is fine; the checker is absent), so not in the table."""
    runtime = tangram.Runtime({"cpu": 1})
    with pytest.raises(errors.InstrumentNotAttachedError, match="no InvariantChecker") as info:
        testing.checker_of(runtime)
    assert isinstance(info.value, LookupError)
