"""Throughput under an API limit: tangram's quota client vs a bare semaphore client.

A loopback :class:`tangram.testing.QuotaServer` enforcing a request rate runs in a child
process (a provider is another machine: sharing the client's event loop and CPU would
make the server's own clock lag and bunch arrivals that left the client evenly spaced).
The same load goes through

1. ``asyncio.Semaphore``-bounded httpx (verl's approach), retrying each ``429`` after
   the server's ``retry-after-ms``;
2. tangram with the limit configured right;
3. tangram configured 3x above the real limit (AIMD must find it).

Figures come from the server's own log: accepted requests per second as a share of its
real limit, and its count of ``429`` answers. A human-readable table goes first; the last
stdout line is one JSON object. Exits 0 even when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx
import stamina.instrumentation

import tangram
from tangram.quota import DEFAULT_HEADROOM, ApiKey, Quota
from tangram.testing import Limit, QuotaServer

LIMIT = 50.0  # requests per second the server allows
BURST = 10.0  # the server's burst
LATENCY = 0.02  # seconds each accepted request takes
SEMAPHORE = 32  # the bare client's concurrency bound


async def _serve() -> None:
    """Child process: serve until stdin closes, then print the server's log as JSON."""
    async with QuotaServer(Limit(requests=LIMIT, requests_burst=BURST), latency=LATENCY) as server:
        print(server.port, flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)
        log = {
            "accepted": [t for t, _, _ in server.accepted],
            "rejected": [t for t, _ in server.rejected],
        }
    print(json.dumps(log), flush=True)


async def _bare(url: str, n: int) -> None:
    sem = asyncio.Semaphore(SEMAPHORE)
    async with httpx.AsyncClient(base_url=url) as client:

        async def one() -> None:
            async with sem:
                while True:
                    response = await client.get("/v1", headers={"Authorization": "Bearer k"})
                    if response.status_code != 429:
                        return
                    await asyncio.sleep(float(response.headers["retry-after-ms"]) / 1000)

        await asyncio.gather(*(one() for _ in range(n)))


async def _tangram(url: str, n: int, configured: float) -> dict[str, float]:
    quota = Quota(
        [
            ApiKey(
                name="k",
                requests=tangram.Rate(configured, burst=BURST),
                headers={"Authorization": "Bearer k"},
            )
        ]
    )
    async with tangram.Runtime(capacity={"cpu": 1}), quota.client(base_url=url) as client:
        codes = await asyncio.gather(*(client.get("/v1") for _ in range(n)))
    stats = quota.stats()["k"]
    return {
        "ok": float(sum(r.status_code == 200 for r in codes)),
        "final_rate_share": stats.rate_share * configured * DEFAULT_HEADROOM / LIMIT,
    }


async def _run(n: int, configured: float | None) -> dict[str, float]:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--serve",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        port = int(await child.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        start = time.monotonic()
        extra: dict[str, float] = {}
        if configured is None:
            await _bare(url, n)
        else:
            extra = await _tangram(url, n, configured)
        child.stdin.close()
        log = json.loads(await child.stdout.readline())
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    accepted: list[float] = log["accepted"]
    rejected: list[float] = log["rejected"]
    # Throughput once settled: after the first second (the start-up burst), or after the
    # 10 s a client configured above the limit has to converge in.
    settle = 1.0 if configured is None or configured <= LIMIT else 10.0
    steady = [t for t in accepted if t >= start + settle]
    span = max(1e-9, steady[-1] - steady[0]) if len(steady) > 1 else 1e-9
    return {
        "requests": float(n),
        "accepted": float(len(accepted)),
        "share_of_limit": (len(steady) - 1) / span / LIMIT,
        "rejected_429": float(len(rejected)),
        "last_429_s": max((t - start for t in rejected), default=0.0),
        "seconds": time.monotonic() - start,
        **extra,
    }


def _table(figures: dict[str, dict[str, float]]) -> str:
    rows = [
        f"server limit {LIMIT:g}/s, burst {BURST:g}, latency {LATENCY * 1000:g} ms",
        f"{'client':<34}{'requests':>9}{'share':>8}{'429s':>7}{'last 429':>10}{'time':>8}",
    ]
    for name, f in figures.items():
        rows.append(
            f"{name:<34}{f['requests']:>9.0f}{f['share_of_limit']:>8.1%}"
            f"{f['rejected_429']:>7.0f}{f['last_429_s']:>9.1f}s{f['seconds']:>7.1f}s"
        )
    return "\n".join(rows)


async def main(quick: bool) -> dict[str, object]:
    # Each retry would log a line; the table below counts them instead.
    stamina.instrumentation.set_on_retry_hooks([])
    seconds = 4.0 if quick else 20.0
    n = int(LIMIT * seconds)
    bare = await _run(n, None)
    known = await _run(n, LIMIT)
    unknown = await _run(int(LIMIT * (15.0 if quick else 40.0)), 3 * LIMIT)
    figures = {
        f"semaphore({SEMAPHORE}) + retry": bare,
        "tangram, limit known": known,
        "tangram, configured 3x limit": unknown,
    }
    print(_table(figures))

    def target(value: float, goal: str, met: bool) -> dict[str, object]:
        return {"value": round(value, 4), "goal": goal, "met": met}

    targets = {
        "known_share_of_limit": target(
            known["share_of_limit"], ">= 0.95", known["share_of_limit"] >= 0.95
        ),
        "known_429s": target(known["rejected_429"], "== 0", known["rejected_429"] == 0),
        "unknown_last_429_s": target(unknown["last_429_s"], "<= 10", unknown["last_429_s"] <= 10),
        "unknown_all_completed": target(
            unknown["ok"] / unknown["requests"], "== 1", unknown["ok"] == unknown["requests"]
        ),
        "unknown_share_of_limit": target(
            unknown["share_of_limit"], ">= 0.9", unknown["share_of_limit"] >= 0.9
        ),
    }
    named = {
        "semaphore": bare,
        "tangram_known": known,
        "tangram_unknown": unknown,
    }
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
