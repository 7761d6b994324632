"""Throughput under an API limit: tangram's quota client vs verl's limiter and a bare semaphore.

A loopback :class:`tangram.testing.QuotaServer` enforcing a request rate runs in a child
process (a provider is another machine: sharing the client's event loop and CPU would
make the server's own clock lag and bunch arrivals that left the client evenly spaced).
Each arm is a batch of samples that each send one request after another, more than the
server's limit lets through, for a fixed time; then what is left is cancelled:

1. ``asyncio.Semaphore``-bounded httpx, retrying each ``429`` after the server's
   ``retry-after-ms``: a rollout with no rate limiter at all;
2. verl's own limiter, from the installed verl: the request-rate ``AsyncTokenBucket``
   and the concurrency cap that ``RateLimitedRewardManager.init_class`` builds from a
   ``reward`` config (``max_rpm``, ``max_concurrent``), taken in the order its
   ``run_single`` takes them, around a score function that retries each ``429`` after
   ``retry-after-ms`` as the bare client does; ``max_rpm`` set right, 3x too high and
   half too low for the server's real limit;
3. tangram's quota client configured with the same three rates. Set right, it trusts the
   configured rate (the default ``Adapt``); set wrong, it is told the rate is a guess
   (``Adapt(above=4)``): AIMD finds the real limit below it or probes up to it above.

Figures come from the server's own log: accepted requests per second in the settled
window (after the convergence allowance) as a share of its real limit, and its ``429``
answers, in all and in the settled window. A human-readable table goes first; the last
stdout line is one JSON object. Exits 0 even when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

import tangram
from tangram.quota import Adapt, ApiKey, Quota
from tangram.testing import Limit, QuotaServer

LIMIT = 50.0  # requests per second the server allows
BURST = 10.0  # the server's burst
LATENCY = 0.02  # seconds each accepted request takes
SEMAPHORE = 32  # the bare client's concurrency bound, and verl's `max_concurrent`
BATCH = 256  # samples of a rollout batch, each sending its next request when one returns
SETTINGS = {"right": 1.0, "3x too high": 3.0, "half too low": 0.5}
"""How far the configured rate is from the server's real one, per setting."""
GUESS = Adapt(above=4.0)
"""Tangram's AIMD when the configured rate is only a guess at the provider's limit."""

Send = Callable[[], Awaitable[int]]
Client = Callable[[str, str, float], contextlib.AbstractAsyncContextManager[Send]]
"""An arm: given the server's URL, its key and the rate factor, a way to send one request."""
Run = tuple[float, int]


async def _serve() -> None:
    """Child process: serve until stdin closes, then print the server's log as JSON.

    Each arm sends with a key of its own, so each meets a fresh limit.
    """
    async with QuotaServer(Limit(requests=LIMIT, requests_burst=BURST), latency=LATENCY) as server:
        print(server.port, flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)
        log = {
            "accepted": [(t, key) for t, key, _ in server.accepted],
            "rejected": server.rejected,
        }
    print(json.dumps(log), flush=True)


async def _get_retrying(client: httpx.AsyncClient, key: str) -> int:
    """One request, retried after each 429 as the server asks: a plain rollout's habit."""
    while True:
        response = await client.get("/v1", headers={"Authorization": f"Bearer {key}"})
        if response.status_code != 429:
            return response.status_code
        await asyncio.sleep(float(response.headers["retry-after-ms"]) / 1000)


@contextlib.asynccontextmanager
async def _bare(url: str, key: str, factor: float) -> AsyncIterator[Send]:
    sem = asyncio.Semaphore(SEMAPHORE)
    async with httpx.AsyncClient(base_url=url) as client:

        async def send() -> int:
            async with sem:
                return await _get_retrying(client, key)

        yield send


@contextlib.asynccontextmanager
async def _verl(url: str, key: str, factor: float) -> AsyncIterator[Send]:
    from omegaconf import DictConfig
    from verl.experimental.reward_loop.reward_manager.limited import RateLimitedRewardManager

    # A subclass per arm: verl keeps its limiters on the class, built once per process.
    class Manager(RateLimitedRewardManager):  # type: ignore[misc]
        pass

    reward = {"max_concurrent": SEMAPHORE, "max_rpm": LIMIT * factor * 60}
    Manager.init_class(DictConfig({"reward": reward}), tokenizer=None)
    async with httpx.AsyncClient(base_url=url) as client:

        async def send() -> int:
            # What `run_single` does around the user's score function.
            await Manager._rpm_limiter.acquire(1.0)
            async with Manager._semaphore:
                return await asyncio.wait_for(_get_retrying(client, key), timeout=300.0)

        yield send


@contextlib.asynccontextmanager
async def _tangram(url: str, key: str, factor: float) -> AsyncIterator[Send]:
    rate = tangram.Rate(LIMIT * factor, burst=BURST)
    api_key = ApiKey(name="k", requests=rate, headers={"Authorization": f"Bearer {key}"})
    quota = Quota([api_key]) if factor == 1.0 else Quota([api_key], adapt=GUESS)
    async with tangram.Runtime(capacity={"cpu": 1}), quota.client(base_url=url) as client:

        async def send() -> int:
            return (await client.get("/v1")).status_code

        yield send


@contextlib.asynccontextmanager
async def _tangram_job(url: str, key: str, factor: float) -> AsyncIterator[Send]:
    """The same quota as the job's (``mode = "shared"``, the adapters' default): run by
    the job's scheduler process, which sends each request this process hands it.

    Opened as ``_session`` opens a ``[quota.NAME]`` table, but with the key's burst set as
    in the arm above (a config's ``requests = "50/s"`` has a burst of 50).
    """
    from tangram._shared._node import open_node
    from tangram._shared._quotas import JobQuota

    rate = tangram.Rate(LIMIT * factor, burst=BURST)
    keys = [{"name": "k", "requests": rate, "headers": {"Authorization": f"Bearer {key}"}}]
    capacity = Quota([ApiKey(**keys[0])], name="job").capacity()
    async with open_node(capacity=capacity, config=f"api-quota-{key}-{time.time()}") as remote:
        quota = JobQuota(remote, "job", keys, {})
        async with quota.client(base_url=url) as client:

            async def send() -> int:
                return (await client.get("/v1")).status_code

            yield send


async def _drive(client: Client, url: str, key: str, factor: float, seconds: float) -> Run:
    """Run one arm's batch for ``seconds``; its start time and how many requests failed.

    What the process holds by now (the arms before, verl and what it imports) is frozen
    out of the garbage collector first: a full collection over it stopped the loop for
    130-306 ms, past what any client's budget carries (tangram's key holds 2.5 requests,
    50 ms, at 50/s), and whichever arm it fell in lost a tenth of its window (89% of the
    limit instead of 99%, in one run of three on a loaded machine; with the collector
    off, 98-99% in three). A rollout process with a large heap meets the same pauses:
    see docs/quotas.md.
    """
    gc.collect()
    gc.freeze()
    failed = 0
    stopped = False
    async with client(url, key, factor) as send:

        async def sample() -> None:
            nonlocal failed
            # Not `while True`: on Python 3.11 `asyncio.wait_for` (verl's, around the
            # score function) can swallow the cancellation that ends the arm.
            while not stopped:
                try:
                    failed += await send() != 200
                except Exception as exc:  # a client's own error: count it, show the first
                    if not failed:
                        print(f"{key}: {exc!r}", file=sys.stderr)
                    failed += 1

        start = time.monotonic()
        tasks = [asyncio.create_task(sample()) for _ in range(BATCH)]
        await asyncio.sleep(seconds)
        stopped = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return start, failed


def _figures(
    log: dict[str, list[tuple[float, str]]], key: str, run: Run, settle: float, window: float
) -> dict[str, float]:
    start, failed = run
    accepted = [t for t, k in log["accepted"] if k == key]
    rejected = [t for t, k in log["rejected"] if k == key]
    begin, end = start + settle, start + settle + window
    return {
        "accepted": float(len(accepted)),
        "share_of_limit": sum(begin <= t < end for t in accepted) / window / LIMIT,
        "rejected_429": float(len(rejected)),
        "settled_429": float(sum(begin <= t < end for t in rejected)),
        "last_429_s": max((t - start for t in rejected), default=0.0),
        "failed": float(failed),
    }


async def _run_all(
    arms: dict[str, tuple[Client, float]], settle: float, window: float
) -> dict[str, dict[str, float]]:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--serve",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    runs: dict[str, Run] = {}
    try:
        url = f"http://127.0.0.1:{int(await child.stdout.readline())}"
        for name, (client, factor) in arms.items():
            runs[name] = await _drive(client, url, name, factor, settle + window)
        child.stdin.close()
        log = json.loads(await child.stdout.read())
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    return {name: _figures(log, name, run, settle, window) for name, run in runs.items()}


def _sustainable(share: float) -> float:
    """A share of the limit as far as it can last: above 1 in a window is the server's
    burst spent in it (the quick run's two seconds count its 10 tokens as 10%)."""
    return min(share, 1.0)


def _table(figures: dict[str, dict[str, float]], settle: float) -> str:
    rows = [
        f"server limit {LIMIT:g}/s, burst {BURST:g}, latency {LATENCY * 1000:g} ms; "
        f"share and settled 429s after {settle:g} s",
        f"{'client':<34}{'share':>8}{'429s':>7}{'settled':>9}{'last 429':>10}",
    ]
    for name, f in figures.items():
        rows.append(
            f"{name:<34}{f['share_of_limit']:>8.1%}{f['rejected_429']:>7.0f}"
            f"{f['settled_429']:>9.0f}{f['last_429_s']:>9.1f}s"
        )
    return "\n".join(rows)


async def main(quick: bool) -> dict[str, object]:
    settle, window = (3.5, 2.0) if quick else (10.0, 20.0)
    arms: dict[str, tuple[Client, float]] = {"semaphore": (_bare, 1.0)}
    labels = {"semaphore": f"semaphore({SEMAPHORE}) + retry"}
    for setting, factor in SETTINGS.items():
        for arm, client in (("verl", _verl), ("tangram", _tangram)):
            name = f"{arm}_{setting.split()[0]}"
            arms[name] = (client, factor)
            labels[name] = f"{arm}, {setting}"
    arms["tangram_job"] = (_tangram_job, 1.0)
    labels["tangram_job"] = "tangram, right, the job's quota"
    named = await _run_all(arms, settle, window)
    print(_table({labels[k]: v for k, v in named.items()}, settle))

    def target(value: float, goal: str, met: bool) -> dict[str, object]:
        return {"value": round(value, 4), "goal": goal, "met": met}

    targets: dict[str, dict[str, object]] = {}
    right, ours = named["verl_right"], named["tangram_right"]
    targets["right_share_of_limit"] = target(
        ours["share_of_limit"], ">= 0.95", ours["share_of_limit"] >= 0.95
    )
    targets["right_429s"] = target(ours["rejected_429"], "== 0", ours["rejected_429"] == 0)
    # As in the comparisons below: verl's share above the limit is the server's burst
    # spent in the window, which does not last (``_sustainable``), and where verl takes
    # the limit, level within 2% (the plateau's 1% and a request of the quick window).
    versus = ours["share_of_limit"] / _sustainable(right["share_of_limit"])
    at_limit = right["share_of_limit"] >= 0.99
    targets["right_vs_verl_right"] = target(
        versus,
        ">= 0.98 (verl at the limit)" if at_limit else ">= 1",
        versus >= 0.98 if at_limit else versus >= 1,
    )
    # The job's quota (shared mode): the same client, its requests sent by the job's
    # scheduler process, one message each way per request.
    job = named["tangram_job"]
    targets["job_share_of_limit"] = target(
        job["share_of_limit"], ">= 0.95", job["share_of_limit"] >= 0.95
    )
    targets["job_429s"] = target(job["rejected_429"], "== 0", job["rejected_429"] == 0)
    targets["job_none_failed"] = target(job["failed"], "== 0", job["failed"] == 0)
    for setting in ("3x", "half"):
        ours, verl = named[f"tangram_{setting}"], named[f"verl_{setting}"]
        targets[f"{setting}_share_of_limit"] = target(
            ours["share_of_limit"], ">= 0.95", ours["share_of_limit"] >= 0.95
        )
        targets[f"{setting}_settled_429s"] = target(
            ours["settled_429"], "== 0", ours["settled_429"] == 0
        )
        # Found from a wrong rate, against verl told the right one: where verl's right rate
        # takes the server's limit, level within 2% (the plateau's 1% and a request of the
        # quick window), as below.
        versus = ours["share_of_limit"] / _sustainable(right["share_of_limit"])
        at_limit = right["share_of_limit"] >= 0.99
        targets[f"{setting}_vs_verl_right"] = target(
            versus,
            ">= 0.98 (verl at the limit)" if at_limit else ">= 1",
            versus >= 0.98 if at_limit else versus >= 1,
        )
        # Ahead of verl set the same wrong way. Where that rate is too high, verl's limiter
        # limits nothing and takes the server's whole limit by sending many times more
        # requests than it accepts (the semaphore arm shows that ceiling): there, ahead
        # means as much within 2% (the plateau's 1% and a request of the quick window)
        # with fewer 429s, the target below.
        ceiling = verl["share_of_limit"] >= 0.99
        ratio = ours["share_of_limit"] / _sustainable(verl["share_of_limit"])
        targets[f"{setting}_vs_verl_same"] = target(
            ratio,
            ">= 0.98 (verl at the limit)" if ceiling else "> 1",
            ratio >= 0.98 if ceiling else ratio > 1,
        )
        targets[f"{setting}_429s_vs_verl_same"] = target(
            ours["rejected_429"] - verl["rejected_429"],
            "<= 0 (fewer or as few)",
            ours["rejected_429"] <= verl["rejected_429"],
        )
        targets[f"{setting}_none_failed"] = target(ours["failed"], "== 0", ours["failed"] == 0)
    rounded = {k: {m: round(v, 4) for m, v in f.items()} for k, f in named.items()}
    return {"bench": "api_quota", "figures": rounded, "targets": targets}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a run of under a minute")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve())
    else:
        result = asyncio.run(main(args.quick))
        print(json.dumps(result))
