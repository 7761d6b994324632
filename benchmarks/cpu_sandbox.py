"""CPU sandboxes: resize latency, action start, and a real elastic workload, in one run.

1. Resize latency on a parked-and-granted Docker sandbox: a grant applied the way the pool
   applies it (``handle.apply``: the container's cgroup files written directly when the
   daemon is on this machine), and through the Engine API's update endpoint, against the
   same update sent by a bare aiodocker client in the same run (the daemon's own floor:
   dockerd, containerd and ``runc update``; tangram can only add to it).
2. Action start: ``sbx.run("true")`` on a warm sandbox (its runner takes the command over
   the attached stdin) against a bare ``docker exec`` of the same command through the API,
   and against starting a fresh container per action.
3. A real elastic workload: trajectories that alternate "thinking" (the model generating,
   simulated by a wait) with actions that run a real parallel Python test suite, forking
   ``$TANGRAM_CPUS`` workers. Under tangram every trajectory keeps a parked sandbox and
   its actions acquire ``cpu=Elastic(1, N, resizable=True)``; the baseline reserves the
   same cores per trajectory for its whole life (a trajectory waits for a reservation).
   ACT is an action's completion time from when its trajectory wanted it.
4. File moves and stdin on Docker: a ``put`` + ``get`` round trip of 16 MiB (and 300 MiB
   in the full run) on a parked sandbox, and ``wc -c`` of 1, 16 and 128 MiB of stdin, whose
   cost per MiB must not grow with the size.
5. Action start at scale: the start of part 2 while 512 sandboxes are live (32 with
   ``--quick``), each holding its attach connection, against ``docker exec`` at that count.

Without Docker, parts 1-2 and 4-5 are reported as missing and part 3 runs on the local
backend.
A human-readable table goes first; the last stdout line is one JSON object. Exits 0 even
when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import anyio

import tangram
from tangram._sandbox._backend import SandboxBackend
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import SandboxPool

FEW = 16
"""Live sandboxes each Docker pool here reserves memory for (``DockerBackend(sandboxes=)``,
256 by default): a few, so each work dir keeps the 512 MiB the 300 MiB round trip needs."""

# The test suite an action runs: CPU-bound "tests" split over $TANGRAM_CPUS forked workers.
SUITE = r"""
import os, sys
TESTS, WORK = int(sys.argv[1]), int(sys.argv[2])
def test(i):
    x = 0
    for k in range(WORK):
        x = (x * 31 + k + i) % 1000003
    return x
workers = max(1, int(os.environ.get("TANGRAM_CPUS", "1")))
pids = []
for w in range(workers):
    pid = os.fork()
    if pid == 0:
        for i in range(w, TESTS, workers):
            test(i)
        os._exit(0)
    pids.append(pid)
failed = sum(os.waitpid(p, 0)[1] != 0 for p in pids)
print(f"{TESTS} tests, {workers} workers, {failed} failed")
"""


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000 if samples else float("nan")


async def docker_available() -> bool:
    try:
        import aiodocker
    except ImportError:
        return False
    try:
        client = aiodocker.Docker()
        try:
            await client.system.info()
            await client.images.inspect(image())
        finally:
            await client.close()
    except Exception:
        return False
    return True


def image() -> str:
    return os.environ.get("TANGRAM_SANDBOX_IMAGE", "tangram-sandbox-test:latest")


async def resize_latency(rounds: int) -> dict[str, float]:
    import aiodocker

    from tangram._sandbox._cores import format_cpu_list
    from tangram._sandbox._docker._backend import PERIOD_US, DockerBackend, DockerConfig

    backend = DockerBackend(
        config=DockerConfig(image=image(), sync_docker_view=False), sandboxes=FEW
    )
    hosts = await backend.start()
    host = hosts[0]
    handle: Any = await backend.create(host)
    bare = aiodocker.Docker()
    try:
        cores = host.cores
        grants = [(cores[:1], 1.0), (cores, float(len(cores)))]
        applied: list[float] = []
        for i in range(rounds):
            chosen, quota = grants[i % 2]
            started = time.perf_counter()
            await handle.apply(chosen, quota)
            applied.append(time.perf_counter() - started)
        # Interleaved, so both see the same daemon and the same load.
        api: list[float] = []
        daemon: list[float] = []
        for i in range(max(10, rounds // 2)):
            chosen, quota = grants[i % 2]
            values = {
                "CpusetCpus": format_cpu_list(chosen),
                "CpuQuota": int(quota * PERIOD_US),
                "CpuPeriod": PERIOD_US,
            }
            started = time.perf_counter()
            await handle._update((values["CpusetCpus"], values["CpuQuota"]))
            api.append(time.perf_counter() - started)
            started = time.perf_counter()
            await bare._query_json(f"containers/{handle.id}/update", method="POST", data=values)
            daemon.append(time.perf_counter() - started)
    finally:
        await bare.close()
        await handle.destroy()
        await backend.aclose()
    return {
        "resize_fast_path": float(bool(handle.fast_path)),
        "resize_applied_ms": median_ms(applied),
        "resize_api_ms": median_ms(api),
        "resize_daemon_ms": median_ms(daemon),
        "resize_api_over_daemon": median_ms(api) / median_ms(daemon),
    }


async def action_start(rounds: int, fresh_rounds: int) -> dict[str, float]:
    import aiodocker

    from tangram._sandbox._docker._backend import DockerBackend, DockerConfig

    figures: dict[str, float] = {}
    backend = DockerBackend(config=DockerConfig(image=image()), sandboxes=FEW)
    async with (
        SandboxPool(backend, warm=1) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("bench") as sbx,
    ):
        await sbx.run("true")
        warm: list[float] = []
        for _ in range(rounds):
            started = time.perf_counter()
            result = await sbx.run(["true"])
            warm.append(time.perf_counter() - started)
            assert result.ok
        figures["start_warm_ms"] = median_ms(warm)
        handle: Any = sbx._handle
        container = handle.container
        # The same one core a warm action gets: a parked container would make the
        # exec crawl at its 1% share and flatter the runner.
        host = pool.hosts[0]
        await handle.apply(host.cores[:1], 1.0)
        bare: list[float] = []
        for _ in range(rounds):
            started = time.perf_counter()
            exec_ = await container.exec(["true"])
            async with exec_.start(detach=False) as stream:
                while await stream.read_out() is not None:
                    pass
            await exec_.inspect()
            bare.append(time.perf_counter() - started)
        figures["start_docker_exec_ms"] = median_ms(bare)
        await handle.park()
    client = aiodocker.Docker()
    try:
        fresh: list[float] = []
        for _ in range(fresh_rounds):
            started = time.perf_counter()
            container = await client.containers.run(
                {"Image": image(), "Cmd": ["true"], "HostConfig": {"NetworkMode": "none"}}
            )
            await container.wait()
            await container.delete(force=True)
            fresh.append(time.perf_counter() - started)
        figures["start_fresh_container_ms"] = median_ms(fresh)
    finally:
        await client.close()
    return figures


async def file_moves(sizes_mib: list[int], stdin_mib: list[int]) -> dict[str, float]:
    """``put`` then ``get`` of random data on a parked sandbox, and ``wc -c`` of a large stdin.

    Before file moves ran at one core's share they ran at the parked 1%: 16 MiB took 41 s
    in and 17 s out. Stdin is timed per MiB so a cost that grows faster than the size shows.
    """
    from tangram._sandbox._docker._backend import DockerBackend, DockerConfig

    figures: dict[str, float] = {}
    backend = DockerBackend(config=DockerConfig(image=image()), sandboxes=FEW)
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("files") as sbx,
    ):
        for size in sizes_mib:
            data = os.urandom(size << 20)
            started = time.perf_counter()
            await sbx.put("blob", data)
            back = await sbx.get("blob")
            figures[f"roundtrip_{size}mib_s"] = time.perf_counter() - started
            assert back == data
            await sbx.run(["rm", "blob"])
        for size in stdin_mib:
            data = b"z" * (size << 20)
            started = time.perf_counter()
            result = await sbx.run(["wc", "-c"], stdin=data, timeout=120)
            seconds = time.perf_counter() - started
            assert result.ok and int(result.stdout) == len(data), result
            figures[f"stdin_{size}mib_s"] = seconds
    return figures


async def start_at_scale(count: int, rounds: int) -> dict[str, float]:
    """Action start on one sandbox while ``count`` live sandboxes each hold a connection.

    Before the attach streams had a pool of their own a process hung for good past ~100
    live sandboxes; this is the same start as :func:`action_start`, at that count.
    """
    from tangram._sandbox._docker._backend import DockerBackend, DockerConfig

    # Live sandboxes are reserved per daemon (256 by default): this many, plus the probe.
    backend = DockerBackend(config=DockerConfig(image=image()), sandboxes=count + 8)
    figures: dict[str, float] = {"scale_sandboxes": float(count)}
    started = time.perf_counter()
    async with SandboxPool(backend, warm=count) as pool:
        await pool.wait_warm()
        figures["scale_create_s"] = time.perf_counter() - started
        async with tangram.Runtime(capacity=pool.capacity()), pool.sandbox("probe") as sbx:
            await sbx.run("true")
            await pool.wait_warm()  # the checkout's replacement boots before, not during
            warm: list[float] = []
            for _ in range(rounds):
                began = time.perf_counter()
                result = await sbx.run(["true"])
                warm.append(time.perf_counter() - began)
                assert result.ok
            handle: Any = sbx._handle
            await handle.apply(pool.hosts[0].cores[:1], 1.0)
            bare: list[float] = []
            for _ in range(rounds):
                began = time.perf_counter()
                exec_ = await handle.container.exec(["true"], user="65534")
                async with exec_.start(detach=False) as stream:
                    while await stream.read_out() is not None:
                        pass
                await exec_.inspect()
                bare.append(time.perf_counter() - began)
            await handle.park()
        figures["scale_start_warm_ms"] = median_ms(warm)
        figures["scale_start_docker_exec_ms"] = median_ms(bare)
    figures["scale_start_ratio_vs_exec"] = (
        figures["scale_start_warm_ms"] / figures["scale_start_docker_exec_ms"]
    )
    return figures


async def workload(
    backend: SandboxBackend, trajectories: int, steps: int, think: float, tests: int, work: int
) -> dict[str, float]:
    """Run the same trajectories under AOE + elastic grants and under per-trajectory cores."""
    async with SandboxPool(backend, warm=trajectories) as pool:
        capacity = pool.capacity()
        cores = next(iter(capacity.values()))
        # The baseline's reservation: half the cores per trajectory (one on a 2-core box).
        reserve = max(1, cores // 2)
        argv_code = SUITE
        results: dict[str, dict[str, float]] = {}
        for mode in ("tangram", "reserved"):
            acts: list[float] = []
            async with tangram.Runtime(capacity=capacity) as runtime:
                reservations = anyio.Semaphore(max(1, cores // reserve))
                await pool.wait_warm()  # both modes start on parked, ready sandboxes
                start = anyio.current_time()

                async def trajectory(
                    name: str,
                    mode: str = mode,
                    acts: list[float] = acts,
                    reservations: anyio.Semaphore = reservations,
                ) -> None:
                    async with pool.sandbox(name) as sbx:
                        await sbx.put("suite.py", argv_code)
                        wanted = anyio.current_time()
                        if mode == "reserved":
                            # The whole trajectory holds its cores, thinking included.
                            async with reservations:
                                for _ in range(steps):
                                    result = await sbx.run(
                                        [backend.python, "suite.py", str(tests), str(work)],
                                        cpu=reserve,
                                        kind="suite",
                                    )
                                    assert result.ok, result
                                    acts.append(anyio.current_time() - wanted)
                                    await anyio.sleep(think)
                                    wanted = anyio.current_time()
                            return
                        for _ in range(steps):
                            result = await sbx.run(
                                [backend.python, "suite.py", str(tests), str(work)],
                                cpu=tangram.Elastic(1, cores, resizable=True),
                                kind="suite",
                            )
                            assert result.ok, result
                            acts.append(anyio.current_time() - wanted)
                            await anyio.sleep(think)
                            wanted = anyio.current_time()

                async with anyio.create_task_group() as tg:
                    for i in range(trajectories):
                        tg.start_soon(trajectory, f"{mode}-{i}")
                makespan = anyio.current_time() - start
                resizes = runtime.stats().resizes
            results[mode] = {
                "avg_act": statistics.mean(acts),
                "makespan": makespan,
                "resizes": float(resizes),
            }
    base, ours = results["reserved"], results["tangram"]
    return {
        "workload_avg_act_s_tangram": ours["avg_act"],
        "workload_avg_act_s_reserved": base["avg_act"],
        "workload_makespan_s_tangram": ours["makespan"],
        "workload_makespan_s_reserved": base["makespan"],
        "workload_resizes": ours["resizes"],
        "act_ratio": base["avg_act"] / ours["avg_act"],
        "makespan_ratio": base["makespan"] / ours["makespan"],
    }


def target(value: float | None, goal: str) -> dict[str, Any]:
    op, bound = goal.split()
    met = (
        value is not None
        and value == value
        and (value <= float(bound) if op == "<=" else value >= float(bound))
    )
    return {"value": value, "goal": goal, "met": bool(met)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"quick": args.quick}
    docker = await docker_available()
    figures["docker"] = docker
    rounds = 30 if args.quick else 200
    trajectories = 4 if args.quick else 8
    steps = 2 if args.quick else 4
    if docker:
        figures.update(await resize_latency(rounds))
        figures.update(await action_start(rounds, 2 if args.quick else 5))
        figures["start_ratio_vs_exec"] = figures["start_warm_ms"] / figures["start_docker_exec_ms"]
        figures["start_ratio_vs_fresh"] = (
            figures["start_warm_ms"] / figures["start_fresh_container_ms"]
        )
        figures.update(await file_moves([16] if args.quick else [16, 300], [1, 16, 128]))
        figures["stdin_per_mib_ratio_128_vs_16"] = (figures["stdin_128mib_s"] / 128) / (
            figures["stdin_16mib_s"] / 16
        )
        figures.update(await start_at_scale(32 if args.quick else 512, 20 if args.quick else 50))
        from tangram._sandbox._docker._backend import DockerBackend, DockerConfig

        backend: SandboxBackend = DockerBackend(config=DockerConfig(image=image()), sandboxes=FEW)
    else:
        backend = LocalBackend()
    figures["workload_backend"] = "docker" if docker else "local"
    figures.update(
        await workload(
            backend,
            trajectories,
            steps,
            think=1.0,
            tests=16,
            work=150_000 if args.quick else 300_000,
        )
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    args = parser.parse_args()
    started = time.perf_counter()
    figures = anyio.run(main_async, args)
    figures["wall_s"] = time.perf_counter() - started
    for name, value in figures.items():
        if isinstance(value, float) and value != value:
            figures[name] = None  # NaN is not JSON
    targets = {
        # What a resize costs through tangram on this host: the direct cgroup write where
        # the daemon is local (the 25 ms, and the 1 ms of the fast path). The
        # Engine API path cannot beat the daemon's own update (~25 ms here, most of it
        # ``runc update``): it is held to that floor instead.
        "resize_applied_ms": target(figures.get("resize_applied_ms"), "<= 1"),
        "resize_api_over_daemon": target(figures.get("resize_api_over_daemon"), "<= 1.15"),
        "start_ratio_vs_exec": target(figures.get("start_ratio_vs_exec"), "<= 0.25"),
        "roundtrip_16mib_s": target(figures.get("roundtrip_16mib_s"), "<= 2"),
        "stdin_per_mib_ratio_128_vs_16": target(
            figures.get("stdin_per_mib_ratio_128_vs_16"), "<= 1.5"
        ),
        "scale_start_ratio_vs_exec": target(figures.get("scale_start_ratio_vs_exec"), "<= 0.25"),
    }
    if not args.quick:
        targets["roundtrip_300mib_s"] = target(figures.get("roundtrip_300mib_s"), "<= 30")
        targets["scale_sandboxes"] = target(figures.get("scale_sandboxes"), ">= 512")
    width = max(len(name) for name in figures)
    for name, value in figures.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{name:<{width}}  {shown}")
    for name, info in targets.items():
        print(f"target {name}: {info['value']} (goal {info['goal']}) met={info['met']}")
    sys.stdout.flush()
    print(json.dumps({"bench": "cpu_sandbox", "figures": figures, "targets": targets}))


if __name__ == "__main__":
    main()
