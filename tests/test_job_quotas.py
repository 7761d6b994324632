"""``[quota.NAME]`` in shared mode: one quota for the job, run by the job's scheduler.

A quota's limit is its provider's, for the whole job. Before, a worker in shared mode (the
default) failed its first API request with ``SettingTypeError`` (a Quota needs a runtime
of its own process), and in local mode each worker process ran a quota of its own at the
full rate. Here worker processes started as a launcher starts them (plain processes
without Ray, sharing the node's scheduler process; Ray actors on a real local Ray
cluster) send through ``resources.quota(name).client()`` to
:class:`tangram.testing.QuotaServer` on loopback, which refuses (``429``) what a
provider would. The control runs the same workers with ``mode = "local"``: the server
refuses some of their requests, so the zero of the shared runs is the quota's doing.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

from tangram import Rate, Runtime
from tangram._frameworks import _session
from tangram._shared import _quotas
from tangram._shared._cluster import ClusterSchedulerActor
from tangram._shared._quotas import QuotaDesk, _portable, _rebuilt
from tangram.errors import InvalidSettingError, QuotaDeadlineError
from tangram.testing import Limit, QuotaServer

RATE = 8  # requests a second, the server's limit and the key's
WORKERS = 3
REQUESTS = 8  # per worker: three workers' bursts at once are three times the limit's

WORKER = textwrap.dedent(
    """
    import anyio, json, sys
    from tangram._frameworks import _session

    async def main(url: str, n: int) -> None:
        async with _session.session() as resources:
            quota = resources.quota("search")
            statuses = []
            async with quota.client(base_url=url) as http:

                async def one(i: int) -> None:
                    statuses.append((await http.get(f"/q/{i}")).status_code)

                async with anyio.create_task_group() as tg:
                    for i in range(n):
                        tg.start_soon(one, i)
            print(json.dumps({"statuses": statuses, "stats": {
                k: s.sent for k, s in quota.stats().items()}}))

    anyio.run(main, sys.argv[1], int(sys.argv[2]))
    """
)


def _config(path: Path, mode: str, extra: str = "") -> Path:
    path.write_text(
        f'mode = "{mode}"\n'
        "[quota.search]\n"
        f'keys = [{{ name = "a", requests = "{RATE}/s", '
        'headers = { Authorization = "Bearer a" } }]\n' + extra
    )
    return path


async def _run_workers(tmp_path: Path, mode: str) -> tuple[QuotaServer, list[dict[str, Any]]]:
    env = dict(
        os.environ,
        TANGRAM_CONFIG=str(_config(tmp_path / f"{mode}.toml", mode)),
        TANGRAM_RUN_DIR=str(tmp_path / "run"),
        TANGRAM_JOB=f"quota-{mode}-{tmp_path.name}",
    )
    outputs: list[dict[str, Any]] = []
    async with QuotaServer(Limit(requests=RATE, requests_burst=RATE)) as server:

        async def worker() -> None:
            done = await anyio.run_process(
                [sys.executable, "-c", WORKER, server.url, str(REQUESTS)], env=env, check=False
            )
            assert done.returncode == 0, done.stderr.decode()[-3000:]
            outputs.append(json.loads(done.stdout.decode().strip().splitlines()[-1]))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for _ in range(WORKERS):
                    tg.start_soon(worker)
    return server, outputs


@pytest.mark.anyio
async def test_worker_processes_without_ray_share_the_jobs_quota(tmp_path: Path) -> None:
    server, outputs = await _run_workers(tmp_path, "shared")
    assert [sorted(o["statuses"]) for o in outputs] == [[200] * REQUESTS] * WORKERS
    assert len(server.accepted) == WORKERS * REQUESTS
    assert server.rejected == []  # three workers, one limit: the provider's
    # Each worker reads the job's figures: every request of the job went through key a.
    assert max(o["stats"]["a"] for o in outputs) == WORKERS * REQUESTS


@pytest.mark.anyio
async def test_the_control_workers_with_a_quota_each_are_refused(tmp_path: Path) -> None:
    """Without a job's quota the same workers overrun the provider: the server refuses."""
    server, outputs = await _run_workers(tmp_path, "local")
    assert server.rejected  # what the shared run's zero is measured against
    assert all(o["stats"]["a"] >= REQUESTS for o in outputs)  # each counts only its own


@pytest.fixture
def anyio_backend() -> str:
    """The job's scheduler is reached from asyncio only (see ``open_node``)."""
    return "asyncio"


@pytest.fixture
async def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """This test's process as a worker of a job without Ray, on a quota of one slot."""
    monkeypatch.setenv("TANGRAM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TANGRAM_JOB", f"quota-{tmp_path.name}")
    path = tmp_path / "slot.toml"
    path.write_text(
        "[quota.search]\n"  # no mode: shared
        'keys = [{ name = "a", concurrency = 1, headers = { Authorization = "Bearer a" } }]\n'
        "[quota.wide]\n"
        'keys = [{ name = "w", concurrency = 500, headers = { Authorization = "Bearer w" } }]\n'
    )
    try:
        async with _session.session(path) as resources:
            yield resources
    finally:
        await _session.aclose(path)


@pytest.mark.anyio
async def test_a_cancelled_request_gives_its_slot_back_at_once(job: Any) -> None:
    """The request is cancelled at the job's scheduler too: the next one does not wait
    for the first one's 30 s answer (its slot is the key's only one)."""
    quota = job.quota("search")
    server = QuotaServer(latency=30.0)
    async with server, quota.client(base_url=server.url, timeout=60.0) as http:
        with anyio.move_on_after(0.5) as scope:
            await http.get("/slow")
        assert scope.cancelled_caught
        server.latency = 0.0
        with anyio.fail_after(5):  # a slot held until the first's answer (30 s) fails this
            response = await http.get("/fast")
    assert response.status_code == 200
    stats = await job.scheduler.stats()
    assert stats.resources["search.a.concurrency"].held == 0


@pytest.mark.anyio
async def test_the_jobs_quota_raises_its_own_errors_in_the_worker(job: Any) -> None:
    quota = job.quota("search")
    async with QuotaServer(latency=30.0) as server, quota.client(base_url=server.url) as http:
        with pytest.raises(QuotaDeadlineError, match="deadline"):
            await http.get("/slow", extensions={"tangram.deadline": 1.0})
    async with quota.client(base_url="http://127.0.0.1:9") as http:  # nothing listens
        with pytest.raises((httpx.ConnectError, QuotaDeadlineError)) as raised:
            await http.get("/x", extensions={"tangram.deadline": 2.0})
    assert isinstance(raised.value, QuotaDeadlineError) or raised.value.request.url.port == 9


@pytest.mark.anyio
async def test_what_cannot_travel_to_the_jobs_scheduler_is_refused_at_the_call(job: Any) -> None:
    quota = job.quota("search")
    with pytest.raises(InvalidSettingError, match="transport"):
        quota.client(transport=httpx.MockTransport(lambda request: httpx.Response(200)))

    async def trace(name: str, info: dict[str, Any]) -> None:
        pass

    async with quota.client(base_url="http://127.0.0.1:9") as http:
        with pytest.raises(InvalidSettingError, match="trace"):
            await http.get("/x", extensions={"trace": trace})


@pytest.mark.anyio
async def test_a_worker_joins_after_the_jobs_quota_cut_its_rates(tmp_path: Path) -> None:
    """AIMD changes the job's rates at run time; a worker stating the configured ones
    still joins (it was refused as stating another capacity)."""
    config = tmp_path / "cut.toml"
    config.write_text(
        "[quota.search]\n"
        'keys = [{ name = "a", requests = "40/s", headers = { Authorization = "Bearer a" } }]\n'
    )
    env = dict(
        os.environ,
        TANGRAM_CONFIG=str(config),
        TANGRAM_RUN_DIR=str(tmp_path / "run"),
        TANGRAM_JOB=f"cut-{tmp_path.name}",
    )
    async with QuotaServer(Limit(requests=4, requests_burst=2)) as server:
        first = await anyio.run_process(
            [sys.executable, "-c", WORKER, server.url, "30"], env=env, check=False
        )
        assert first.returncode == 0, first.stderr.decode()[-3000:]
        assert server.rejected  # the provider refused: AIMD cut the key's rates
        later = await anyio.run_process(
            [sys.executable, "-c", WORKER, server.url, "1"], env=env, check=False
        )
    assert later.returncode == 0, later.stderr.decode()[-3000:]
    assert json.loads(later.stdout.decode().splitlines()[-1])["statuses"] == [200]


@pytest.mark.anyio
async def test_a_killed_workers_request_gives_its_slot_back(job: Any, tmp_path: Path) -> None:
    """A worker killed mid-request hangs up on the job's scheduler, which cancels the
    request there: the key's one slot does not wait for the 30 s answer."""
    script = tmp_path / "slot.py"
    script.write_text(
        textwrap.dedent(
            """
            import anyio, sys
            from tangram._frameworks import _session

            async def main() -> None:
                async with _session.session(sys.argv[2]) as resources:
                    async with resources.quota("search").client(timeout=60) as http:
                        print("sending", flush=True)
                        await http.get(sys.argv[1] + "/slow")

            anyio.run(main)
            """
        )
    )
    quota = job.quota("search")
    server = QuotaServer(latency=30.0)
    async with (
        server,
        await anyio.open_process(
            [sys.executable, str(script), server.url, str(tmp_path / "slot.toml")]
        ) as worker,
    ):
        assert worker.stdout is not None
        assert b"sending" in await worker.stdout.receive()
        with anyio.fail_after(20):
            while server.in_flight("a") == 0:  # noqa: ASYNC110 - the server's count
                await anyio.sleep(0.05)
        worker.kill()
        await worker.wait()
        server.latency = 0.0
        async with quota.client(base_url=server.url, timeout=60.0) as http:
            with anyio.fail_after(10):  # a slot held to the first's answer fails this
                response = await http.get("/fast")
    assert response.status_code == 200


async def _raw_server(answer: bytes, seen: list[bytes]) -> Any:
    """A loopback HTTP/1.1 server that answers ``answer`` to one request per connection
    and keeps each request's bytes: what the provider saw, framing included."""

    async def serve(stream: Any) -> None:
        data = b""
        async with stream:
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            while len(body) < length:
                body += await stream.receive()
            seen.append(head + b"\r\n\r\n" + body)
            await stream.send(answer)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    return listener, serve


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["shared", "local"])
async def test_headers_reason_and_a_streamed_body_arrive_as_sent(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Header bytes that are not ASCII, a reason phrase of the provider's own, and a body
    given as a stream (sent whole once read: never chunk-framed beside a length)."""
    monkeypatch.setenv("TANGRAM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TANGRAM_JOB", f"wire-{tmp_path.name}")
    path = _config(tmp_path / "wire.toml", mode)
    answer = b"HTTP/1.1 299 Custom Reason\r\nX-Name: caf\xe9\r\nContent-Length: 2\r\n\r\nok"
    seen: list[bytes] = []
    listener, serve = await _raw_server(answer, seen)

    async def body() -> Any:
        yield b"abc"
        yield b"def"

    try:
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            async with (
                _session.session(path) as resources,
                resources.quota("search").client(base_url=f"http://127.0.0.1:{port}") as http,
            ):
                response = await http.post(
                    "/x", content=body(), headers={"X-Mine": "d\xe9j\xe0".encode("latin-1")}
                )
            tg.cancel_scope.cancel()
    finally:
        await _session.aclose(path)
    assert response.status_code == 299
    assert response.reason_phrase == "Custom Reason"
    assert (b"X-Name", b"caf\xe9") in response.headers.raw
    assert response.text == "ok"
    head, _, sent = seen[0].partition(b"\r\n\r\n")
    assert sent == b"abcdef"
    assert b"transfer-encoding" not in head.lower()
    assert b"content-length: 6" in head.lower()
    assert b"x-mine: d\xe9j\xe0" in head.lower()


@pytest.mark.anyio
async def test_more_requests_in_flight_than_a_connection_pool_holds(job: Any) -> None:
    """The quota's slots bound what is in flight, not a pool of 100 connections: of 150
    requests at once more than 100 reach the server together, none failed on the pool."""
    quota = job.quota("wide")
    assert quota.stats()["w"].sent == 0  # before its first answer: zeros, as a Quota
    async with QuotaServer(latency=3.0) as server, quota.client(base_url=server.url) as http:
        codes: list[int] = []

        async def one() -> None:
            codes.append((await http.get("/q")).status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(150):
                tg.start_soon(one)
    assert codes == [200] * 150
    assert server.peak_in_flight["w"] > 100  # httpx's pool held 100, and failed the rest
    assert quota.stats()["w"].failed == 0


def test_a_cancellation_no_request_claims_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    desk = QuotaDesk(Runtime({"x": 1}))
    now = 1000.0
    monkeypatch.setattr(_quotas.time, "monotonic", lambda: now)
    desk.cancel("early")  # its request may still come: kept
    assert "early" in desk._cancelled
    now += _quotas._FORGET + 1
    desk.cancel("later")
    assert list(desk._cancelled) == ["later"]


@pytest.mark.anyio
async def test_a_worker_stating_other_keys_fails_when_it_joins(job: Any, tmp_path: Path) -> None:
    """At its session's start, not at a first API request hours into the run; and the
    job's kinds include the quota's from the first worker on."""
    assert "search.a.concurrency" in job.scheduler.capacity
    path = tmp_path / "slot.toml"  # the job's file, changed under a running job
    path.write_text(path.read_text().replace("concurrency = 1", "concurrency = 2"))
    code = textwrap.dedent(
        """
        import anyio, sys
        from tangram._frameworks import _session

        async def main() -> None:
            async with _session.session(sys.argv[1]):
                pass

        anyio.run(main)
        """
    )
    joined = await anyio.run_process([sys.executable, "-c", code, str(path)], check=False)
    assert joined.returncode != 0
    assert "ConfigError: [quota.search]" in joined.stderr.decode()
    assert "same quotas" in joined.stderr.decode()


@pytest.mark.anyio
async def test_the_scheduler_states_a_quotas_kinds_as_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a joining worker's capacity is compared with: AIMD's cut aside."""
    monkeypatch.setattr(ClusterSchedulerActor, "_node_id", lambda self: "here")  # no Ray
    actor = ClusterSchedulerActor({"x": 1}, None, 1.0, 10.0, "token")
    try:
        await actor.quota_open("search", [{"name": "a", "requests": "40/s"}], {})
        runtime = await actor._ready()
        runtime.set_capacity({"search.a.requests": Rate(4, burst=1)})  # as AIMD cuts it
        assert runtime.capacity["search.a.requests"].total == 4
        info = await actor.info()
        assert info["capacity"]["search.a.requests"].total == 40
        assert info["capacity"]["x"].total == 1
    finally:
        await actor.close()


@pytest.mark.anyio
async def test_a_dropped_workers_requests_end_at_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On Ray a dead worker's call runs on (Ray cancels no actor call for its caller):
    the scheduler ends it when it drops the worker, a lease timeout after its last beat,
    and its slot comes back then, not at the provider's answer."""
    monkeypatch.setattr(ClusterSchedulerActor, "_node_id", lambda self: "here")  # no Ray
    actor = ClusterSchedulerActor({"x": 1}, None, 1.0, 10.0, "token")
    try:
        await actor.quota_open("q", [{"name": "w", "concurrency": 1}], {})
        actor._client("worker")  # a proxy the scheduler knows, as after its first poll
        async with QuotaServer(latency=30.0) as server, anyio.create_task_group() as tg:
            answers: list[tuple[Any, ...]] = []

            async def send() -> None:
                wire = ("GET", f"{server.url}/slow", [(b"authorization", b"Bearer w")], b"", {})
                answers.append(await actor.quota_send("q", "worker-1", wire))

            tg.start_soon(send)
            with anyio.fail_after(10):
                while server.in_flight("w") == 0:  # noqa: ASYNC110 - the server's count
                    await anyio.sleep(0.02)
            runtime = await actor._ready()
            assert runtime.stats().resources["q.w.concurrency"].held == 1
            actor._drop_client("worker", expired=True)
            with anyio.fail_after(5):
                while not answers:  # noqa: ASYNC110 - the call's own answer
                    await anyio.sleep(0.02)
        assert answers == [("cancelled",)]
        assert runtime.stats().resources["q.w.concurrency"].held == 0
    finally:
        await actor.close()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["shared", "local"])
async def test_a_key_with_its_own_url_says_that_host(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ApiKey(url=...)`` sends to its own host, and names it in ``Host`` (the client's
    was the base URL's: a provider behind a name-based proxy would refuse it)."""
    monkeypatch.setenv("TANGRAM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TANGRAM_JOB", f"host-{tmp_path.name}")
    seen: list[bytes] = []
    listener, serve = await _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", seen)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    path = tmp_path / "host.toml"
    path.write_text(
        f'mode = "{mode}"\n[quota.search]\n'
        f'keys = [{{ name = "a", concurrency = 1, url = "http://127.0.0.1:{port}" }}]\n'
    )
    try:
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            async with (
                _session.session(path) as resources,
                resources.quota("search").client(base_url="http://localhost:1") as http,
            ):
                response = await http.get("/x")
            tg.cancel_scope.cancel()
    finally:
        await _session.aclose(path)
    assert response.status_code == 200
    assert f"host: 127.0.0.1:{port}\r\n".encode() in seen[0].lower()


def test_a_scheduler_has_half_its_files_for_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past httpx's 100, short of every file the process has (its heartbeats need some)."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(_quotas.resource, "setrlimit", lambda _, limits: calls.append(limits))
    for soft, hard, most in [
        (256, 256, 128),
        (1024, 524288, _quotas._MOST_CONNECTIONS),  # raised to the hard limit first
        (20, 20, 16),
        (_quotas.resource.RLIM_INFINITY,) * 2 + (_quotas._MOST_CONNECTIONS,),
    ]:
        monkeypatch.setattr(_quotas.resource, "getrlimit", lambda _, s=soft, h=hard: (s, h))
        assert _quotas._connections() == most
    assert calls == [(524288, 524288)]


@pytest.mark.anyio
async def test_requests_past_the_connections_wait_for_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Within their deadline, not failing on httpx's pool timeout as the key's failure."""
    monkeypatch.setattr(_quotas, "_connections", lambda: 2)
    async with Runtime({"x": 1}) as runtime, QuotaServer(latency=0.3) as server:
        desk = QuotaDesk(runtime)
        desk.open("q", [{"name": "w", "concurrency": 50}], {})
        headers = [(b"authorization", b"Bearer w")]
        timeout = {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 0.05}
        answers: list[tuple[Any, ...]] = []

        async def one(i: int) -> None:
            wire = ("GET", f"{server.url}/{i}", headers, b"", {"timeout": timeout})
            answers.append(await desk.send("q", f"c-{i}", wire))

        try:
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
        finally:
            await desk.aclose()
    assert [a[:2] for a in answers] == [("ok", 200)] * 8
    assert server.peak_in_flight["w"] == 2
    assert desk.stats("q")["w"].failed == 0


def test_a_worker_stating_other_keys_is_refused() -> None:
    desk = QuotaDesk(Runtime({"x": 1}))
    keys = [{"name": "a", "requests": "5/s"}]
    desk.open("search", keys, {})
    desk.open("search", [dict(k) for k in keys], {})  # the same, stated again: fine
    with pytest.raises(InvalidSettingError, match="same quotas"):
        desk.open("search", [{"name": "a", "requests": "50/s"}], {})
    with pytest.raises(InvalidSettingError, match="same quotas"):
        desk.open("search", keys, {"deadline": 5})


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("bad frame"),
        QuotaDeadlineError("late"),
        InvalidSettingError("bad"),
    ],
)
def test_errors_reach_the_worker_as_their_own_class(error: Exception) -> None:
    request = httpx.Request("GET", "http://example.invalid/x")
    portable = pickle.loads(pickle.dumps(_portable(error)))
    rebuilt = _rebuilt(portable, request)
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error)
    if isinstance(rebuilt, httpx.RequestError):
        assert rebuilt.request is request


def test_an_error_that_pickles_but_does_not_load_travels_as_text() -> None:
    """httpx's StreamConsumed pickles but cannot be built again: it used to reach the
    worker as "the answer could not be loaded", the scheduler's failure."""
    request = httpx.Request("GET", "http://example.invalid/x")
    rebuilt = _rebuilt(pickle.loads(pickle.dumps(_portable(httpx.StreamConsumed()))), request)
    assert "StreamConsumed" in str(rebuilt)


@pytest.mark.anyio
async def test_cancelling_one_quotas_request_leaves_another_quotas_alone(job: Any) -> None:
    """Each quota of a worker numbered its calls from 1: both quotas' first requests were
    one call at the scheduler, and cancelling one cancelled the other, whose caller had
    never stopped waiting, while the cancelled one ran on holding its slot."""
    search, wide = job.quota("search"), job.quota("wide")
    server = QuotaServer(latency=2.0)
    async with (
        server,
        search.client(base_url=server.url, timeout=30) as first,
        wide.client(base_url=server.url, timeout=30) as second,
    ):
        got: list[int] = []

        async def other() -> None:
            got.append((await second.get("/other")).status_code)

        async with anyio.create_task_group() as tg:
            with anyio.move_on_after(0.5) as scope:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(first.get, "/given-up")
                    with anyio.fail_after(10):
                        while server.in_flight("a") == 0:  # noqa: ASYNC110
                            await anyio.sleep(0.02)
                    tg.start_soon(other)
                    await anyio.sleep_forever()
            assert scope.cancelled_caught
            with anyio.fail_after(5):  # the given-up request's slot, back at once
                while (await job.scheduler.stats()).resources["search.a.concurrency"].held:  # noqa: ASYNC110 - polled at the scheduler
                    await anyio.sleep(0.05)
    assert got == [200]


async def _refuse_all(stream: anyio.abc.SocketStream) -> None:
    """A provider that refuses every request, saying why in its body."""
    async with stream:
        data = b""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                while b"\r\n\r\n" not in data:
                    data += await stream.receive()
                _, _, data = data.partition(b"\r\n\r\n")
                await stream.send(
                    b"HTTP/1.1 429 Too Many Requests\r\nretry-after-ms: 1\r\n"
                    b'Content-Length: 16\r\n\r\n{"error":"slow"}'
                )


@pytest.mark.anyio
async def test_the_providers_last_refusal_or_5xx_reaches_the_worker_with_its_body(
    job: Any,
) -> None:
    """A POST answered 500 (not resent) and a 429 after every attempt are the caller's
    answer: they reached the worker as the scheduler's failure (their body was read
    already), and their body was dropped under a Content-Length that still counted it."""
    quota = job.quota("wide")
    async with QuotaServer(failing={"w"}) as server, quota.client(base_url=server.url) as http:
        response = await http.post("/v1/judge", json={"q": 1})
    assert response.status_code == 500
    assert response.json() == {"error": "key failing"}
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, _refuse_all)
        with anyio.fail_after(30):
            async with quota.client(base_url=f"http://127.0.0.1:{port}") as http:
                response = await http.get("/v1/search")
        tg.cancel_scope.cancel()
    assert response.status_code == 429
    assert response.json() == {"error": "slow"}


@pytest.mark.anyio
async def test_a_url_no_transport_can_send_is_not_the_keys_failure(job: Any) -> None:
    """A client without ``base_url`` (or an ``ftp://`` URL) is one caller's mistake: httpx's
    UnsupportedProtocol was counted as the key's failure, resent for seconds, and set the
    job's key aside for every worker."""
    quota = job.quota("wide")
    for url in ("/v1/search", "ftp://127.0.0.1/x"):
        async with quota.client() as http:
            with anyio.fail_after(2), pytest.raises(httpx.UnsupportedProtocol):
                await http.get(url)
    stats = quota.stats()["w"]
    assert stats.failed == 0 and not stats.set_aside, stats


@pytest.mark.anyio
async def test_a_stopped_scheduler_does_not_outlast_the_requests_deadline(job: Any) -> None:
    """The deadline was kept by the scheduler only: with its loop stopped (SIGSTOP stands
    in for a blocked loop) the worker waited with no bound."""
    quota = job.quota("search")
    pid = (await job.scheduler.actor.info.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        async with quota.client(base_url="http://127.0.0.1:9") as http:
            with anyio.fail_after(5), pytest.raises(QuotaDeadlineError, match="did not answer"):
                await http.get("/x", extensions={"tangram.deadline": 1.0})
    finally:
        os.kill(pid, signal.SIGCONT)


class RayWorker:
    """A worker of a Ray job (verl's and OpenRLHF's workers are Ray actors)."""

    async def send(self, path: str, url: str, n: int) -> list[int]:
        import anyio

        from tangram._frameworks import _session

        statuses: list[int] = []
        async with (
            _session.session(path) as resources,
            resources.quota("search").client(base_url=url) as http,
        ):

            async def one(i: int) -> None:
                statuses.append((await http.get(f"/q/{i}")).status_code)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
        await _session.aclose(path)
        return statuses


@pytest.mark.anyio
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["shared", "ray"])
async def test_ray_workers_share_the_jobs_quota(mode: str, tmp_path: Path) -> None:
    """Three Ray actors of one job, one provider's limit: the job's scheduler actor holds
    it (``shared``), or the named scheduler actor they all reach (``ray``)."""
    if os.environ.get("CI"):
        import ray
    else:
        ray = pytest.importorskip("ray")
    import importlib

    importlib.import_module("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])
    extra = f'[ray]\nname = "quota-{tmp_path.name}"\ndetached = true\n' if mode == "ray" else ""
    path = _config(tmp_path / "ray.toml", mode, extra)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        workers = [ray.remote(num_cpus=0)(RayWorker).remote() for _ in range(WORKERS)]
        async with QuotaServer(Limit(requests=RATE, requests_burst=RATE)) as server:
            with anyio.fail_after(180):
                statuses = await anyio.to_thread.run_sync(
                    ray.get, [w.send.remote(str(path), server.url, REQUESTS) for w in workers]
                )
    finally:
        ray.shutdown()
    assert [sorted(s) for s in statuses] == [[200] * REQUESTS] * WORKERS
    assert len(server.accepted) == WORKERS * REQUESTS
    assert server.rejected == []
