"""What a local sandbox command costs to start, as the trainer's memory grows.

What it measures
    ``sbx.run("true")`` in a local sandbox (bubblewrap, a uid and a cgroup per sandbox
    where the host allows), one command at a time, in a process that holds ``N`` MiB of
    touched memory besides (the trainer's weights, buffers, a vLLM engine's host side).
    Two arms take turns, in the same process:

    - *fork server* (shipped): the trainer hands each command to a small process of its
      own (``tangram/_sandbox/_local/_forkserver.py``), which forks it;
    - *trainer forks* (before): the trainer forks each command itself and runs the same
      set-up in the child (``_forkserver._child``, as ``subprocess`` with a
      ``preexec_fn`` must: a ``preexec_fn`` rules out ``vfork``).

    Reported per arm and size: the median wall time per command, and the event loop's
    worst stall meanwhile (a task that sleeps 1 ms at a time, and how late it woke):
    ``fork`` holds the GIL while the kernel copies the trainer's page tables.

Why
    Rollouts run many short commands (tests, a grader's harness). A command's start that
    grows with the trainer's memory caps the commands per second a trainer can start
    (one spawner thread: forks cannot overlap) and stalls its event loop, which serves
    every other trajectory's I/O, once per command.

Targets (at the largest size of the run)
    ``command_vs_trainer_forks``: the fork server's time per command over the trainer
    forking, <= 0.5; ``loop_stall_ms``: the event loop's worst stall with the fork
    server, <= 20 ms (a stall the size of the trainer's fork would be missed).

``--quick``: 0 and 1,024 MiB, 20 commands an arm, in well under a minute; the full run
0, 1,024 and 4,096 MiB, 50 commands. The last line of stdout is one JSON object
(``"bench": "local_spawn"``); exit status 0 whether or not the targets are met.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from typing import Any

import anyio

import tangram
from tangram._sandbox._local import _backend, _forkserver
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import SandboxPool

RATIO_GOAL = 0.5
STALL_GOAL_MS = 20.0


class _Forked:
    """A command the trainer forked itself: what the backend reads of a child."""

    def __init__(self, pid: int, pipes: tuple[Any, Any, Any]) -> None:
        self.pid = pid
        self.pidfd: int | None = os.pidfd_open(pid)
        self.stdin, self.stdout, self.stderr = pipes
        self._status: int | None = None

    def wait(self) -> int:
        if self._status is None:
            _, status = os.waitpid(self.pid, 0)
            self._status = os.waitstatus_to_exitcode(status)
        return self._status

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        for pipe in (self.stdin, self.stdout, self.stderr):
            pipe.close()


def _trainer_forks(
    argv: list[str], env: dict[str, str], cwd: str, fds: list[int], spec: dict[str, Any]
) -> _Forked:
    """The way before: fork this process and set the command up in the child."""
    ends = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]
    theirs = [ends[0][0], ends[1][1], ends[2][1]]
    read, write = os.pipe2(os.O_CLOEXEC)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _forkserver._child(
            {**spec, "argv": argv, "env": env, "cwd": cwd}, theirs + fds, write, parent
        )
    os.close(write)
    for fd in theirs:
        os.close(fd)
    with os.fdopen(read, "rb") as handle:
        failure = handle.read()
    if failure:
        os.waitpid(pid, 0)
        raise RuntimeError(pickle.loads(failure))
    pipes = (
        open(ends[0][1], "wb", buffering=0),  # noqa: SIM115 - closed by close()
        open(ends[1][0], "rb", buffering=0),  # noqa: SIM115
        open(ends[2][0], "rb", buffering=0),  # noqa: SIM115
    )
    return _Forked(pid, pipes)


async def _arm(pool: SandboxPool, commands: int) -> tuple[float, float]:
    """Median seconds per ``true`` and the loop's worst stall over them."""
    worst = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            began = time.perf_counter()
            await anyio.sleep(0.001)
            worst = max(worst, time.perf_counter() - began - 0.001)

    spans: list[float] = []
    async with pool.sandbox("bench") as sbx, anyio.create_task_group() as tasks:
        await sbx.run("true")  # the arm's first, outside the figures
        tasks.start_soon(ticker)
        for _ in range(commands):
            began = time.perf_counter()
            result = await sbx.run("true")
            spans.append(time.perf_counter() - began)
            assert result.exit_code == 0, result
        done.set()
    return statistics.median(spans), worst


async def _measure(sizes: list[int], commands: int, rounds: int) -> dict[str, Any]:
    shipped = _backend.spawn
    figures: dict[str, Any] = {"sizes_mib": sizes, "commands": commands, "rounds": rounds}
    ballast: list[bytearray] = []
    async with (
        SandboxPool(LocalBackend(), warm=1) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        for size in sizes:
            held = size - sum(len(b) for b in ballast) // (1 << 20)
            if held > 0:
                block = bytearray(held << 20)
                for at in range(0, len(block), 4096):
                    block[at] = 1  # touched: resident, its page tables the kernel's to copy
                ballast.append(block)
            per: dict[str, list[tuple[float, float]]] = {"server": [], "trainer": []}
            for turn in range(rounds):
                for arm in ("server", "trainer") if turn % 2 == 0 else ("trainer", "server"):
                    _backend.spawn = shipped if arm == "server" else _trainer_forks  # type: ignore[assignment]
                    try:
                        per[arm].append(await _arm(pool, commands))
                    finally:
                        _backend.spawn = shipped
            server = statistics.median(s for s, _ in per["server"])
            trainer = statistics.median(s for s, _ in per["trainer"])
            stall = max(w for _, w in per["server"])
            before_stall = max(w for _, w in per["trainer"])
            figures[f"{size}mib"] = {
                "server_ms": round(server * 1000, 2),
                "trainer_forks_ms": round(trainer * 1000, 2),
                "ratio": round(server / trainer, 3),
                "server_stall_ms": round(stall * 1000, 1),
                "trainer_forks_stall_ms": round(before_stall * 1000, 1),
            }
            print(
                f"{size:>5} MiB held: fork server {server * 1000:.1f} ms a command (loop stalled "
                f"<= {stall * 1000:.1f} ms), trainer forks {trainer * 1000:.1f} ms (<= "
                f"{before_stall * 1000:.1f} ms): {server / trainer:.2f}x",
                flush=True,
            )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [0, 1024] if args.quick else [0, 1024, 4096]
    commands = 20 if args.quick else 50
    figures = anyio.run(_measure, sizes, commands, 2 if args.quick else 4)
    figures["quick"] = args.quick
    top = figures[f"{sizes[-1]}mib"]
    print(
        json.dumps(
            {
                "bench": "local_spawn",
                "figures": figures,
                "targets": {
                    "command_vs_trainer_forks": {
                        "value": top["ratio"],
                        "goal": f"<= {RATIO_GOAL}",
                        "met": top["ratio"] <= RATIO_GOAL,
                    },
                    "loop_stall_ms": {
                        "value": top["server_stall_ms"],
                        "goal": f"<= {STALL_GOAL_MS:g}",
                        "met": top["server_stall_ms"] <= STALL_GOAL_MS,
                    },
                },
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
