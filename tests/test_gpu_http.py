"""vLLM- and SGLang-style sleep/wake driven over HTTP, against a real loopback server.

The server below is a stand-in for vLLM and SGLang, which need a GPU: it imitates the
endpoints of ``vllm/entrypoints/serve/sleep/api_router.py`` (``POST /sleep?level=1``,
``POST /wake_up``, ``GET /is_sleeping``) and of SGLang's ``http_server.py``
(``POST /release_memory_occupation``, ``POST /resume_memory_occupation``), and answers
``/v1/completions`` with 503 while asleep, so a request the pool sent to a sleeping
server would fail the test. ``fail_wake`` makes a wake answer as a server out of memory.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import anyio
import pytest
from conftest import wait_until

import tangram
from tangram.gpu import (
    Device,
    GpuOutOfMemoryError,
    GpuPool,
    GpuServiceError,
    SglangService,
    VllmService,
)


class FakeVllm(ThreadingHTTPServer):
    sleeping = False
    fail_wake = False
    log: list[str]


class Handler(BaseHTTPRequestHandler):
    server: FakeVllm

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/is_sleeping":
            self.reply(200, {"is_sleeping": self.server.sleeping})
        else:
            self.reply(404, {})

    def do_POST(self) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"null")
        self.server.log.append(url.path)
        vllm_sleep = url.path == "/sleep" and parse_qs(url.query) == {"level": ["1"]}
        sglang_release = url.path == "/release_memory_occupation" and body == {}
        if vllm_sleep or sglang_release:
            self.server.sleeping = True
            self.reply(200, {})
        elif url.path in {"/wake_up", "/resume_memory_occupation"}:
            if self.server.fail_wake:
                self.reply(500, {"error": "CUDA out of memory. Tried to allocate 20.00 GiB"})
                return
            self.server.sleeping = False
            self.reply(200, {})
        elif url.path == "/v1/completions":
            if self.server.sleeping:
                self.reply(503, {"error": "asleep"})
            elif not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
                self.reply(400, {"error": "`prompt` must be a string"})
            else:
                self.reply(200, {"text": body["prompt"].upper()})
        else:
            self.reply(404, {})


@pytest.fixture
def servers() -> Iterator[list[FakeVllm]]:
    running = []
    for _ in range(2):
        server = FakeVllm(("127.0.0.1", 0), Handler)
        server.log = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        running.append(server)
    yield running
    for server in running:
        server.shutdown()
        server.server_close()


def url(server: FakeVllm) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_vllm_sleeps_at_load_wakes_per_action_and_sleeps_to_make_room(
    servers: list[FakeVllm],
) -> None:
    judge = VllmService("judge", {url(servers[0]): ["cuda:0"]}, memory="40GiB")
    teacher = VllmService("teacher", {url(servers[1]): ["cuda:0"]}, memory="40GiB")
    pool = GpuPool([judge, teacher], devices=[Device("cuda:0", "60GiB")], links=[], warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        assert servers[0].sleeping and servers[1].sleeping  # load put both to sleep
        async with pool.use("judge") as svc:
            assert await svc([{"prompt": "a"}, {"prompt": "b"}]) == [{"text": "A"}, {"text": "B"}]
        assert not servers[0].sleeping
        async with pool.use("teacher") as svc:
            assert await svc([{"prompt": "c"}]) == [{"text": "C"}]
        # Both do not fit on the device: the idle judge was put to sleep first.
        assert servers[0].sleeping and not servers[1].sleeping
        assert servers[0].log == [
            "/sleep",
            "/wake_up",
            "/v1/completions",
            "/v1/completions",
            "/sleep",
        ]
    assert servers[1].log[-1] == "/sleep"  # closing the pool evicts what is resident


@pytest.mark.anyio
async def test_sglang_releases_and_resumes(servers: list[FakeVllm]) -> None:
    rm = SglangService("rm", {url(servers[0]): ["cuda:0"]}, memory="1GiB")
    pool = GpuPool([rm], devices=[Device("cuda:0", "2GiB")], links=[], warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        assert servers[0].sleeping
        async with pool.use("rm") as svc:
            assert await svc([{"prompt": "x"}]) == [{"text": "X"}]
    assert servers[0].log == [
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/v1/completions",
        "/release_memory_occupation",
    ]


@pytest.mark.anyio
async def test_two_servers_are_two_replicas_on_their_own_gpus(servers: list[FakeVllm]) -> None:
    judge = VllmService(
        "judge", {url(servers[0]): ["cuda:0"], url(servers[1]): ["cuda:1"]}, memory="40GiB"
    )
    devices = [Device("cuda:0", "60GiB"), Device("cuda:1", "60GiB")]
    pool = GpuPool([judge], devices=devices, links=[])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        release = anyio.Event()
        seen: list[str] = []

        async def action() -> None:
            async with pool.use("judge") as svc:
                seen.append(svc.devices[0].name)
                await release.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(action)
            tg.start_soon(action)
            await wait_until(lambda: len(seen) == 2)
            release.set()
        assert sorted(seen) == ["cuda:0", "cuda:1"]
        assert not servers[0].sleeping and not servers[1].sleeping


@pytest.mark.anyio
async def test_a_wake_out_of_memory_is_typed_and_the_pool_stays_usable(
    servers: list[FakeVllm],
) -> None:
    judge = VllmService("judge", {url(servers[0]): ["cuda:0"]}, memory="40GiB")
    pool = GpuPool([judge], devices=[Device("cuda:0", "60GiB")], links=[], warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        servers[0].fail_wake = True
        with pytest.raises(GpuOutOfMemoryError, match="out of memory"):
            async with pool.use("judge"):
                pass
        assert runtime.stats().resources["gpu_mem:cuda:0"].held == 0
        assert pool.usage()["cuda:0"]["resident"] == 0
        servers[0].fail_wake = False
        async with pool.use("judge") as svc:
            assert await svc([{"prompt": "ok"}]) == [{"text": "OK"}]


@pytest.mark.anyio
async def test_http_errors_are_typed(servers: list[FakeVllm]) -> None:
    service = VllmService("judge", {url(servers[0]) + "/nowhere": ["cuda:0"]}, memory="1GiB")
    pool = GpuPool([service], devices=[Device("cuda:0", "2GiB")], links=[])
    with pytest.raises(GpuServiceError, match="404"):
        async with pool:  # a wrong base URL: /nowhere/is_sleeping answers 404
            pass
    closed = VllmService("judge", {"http://127.0.0.1:9": ["cuda:0"]}, memory="1GiB")
    with pytest.raises(GpuServiceError, match="judge"):
        async with GpuPool([closed], devices=[Device("cuda:0", "2GiB")], links=[]):
            pass


@pytest.mark.anyio
async def test_a_malformed_request_fails_only_its_own_action(servers: list[FakeVllm]) -> None:
    gate = anyio.Event()
    first = anyio.Event()

    async def request(client: Any, item: Any) -> Any:
        if not first.is_set():  # hold the first run, so the next calls merge into one
            first.set()
            await gate.wait()
        response = await client.post("/v1/completions", json=item)
        response.raise_for_status()
        return response.json()

    judge = VllmService("judge", {url(servers[0]): ["cuda:0"]}, memory="1GiB", request=request)
    pool = GpuPool([judge], devices=[Device("cuda:0", "2GiB")], links=[])
    results: dict[str, Any] = {}

    async def action(name: str, batch: list[Any]) -> None:
        async with pool.use("judge") as svc:
            try:
                results[name] = await svc(batch)
            except GpuServiceError as exc:
                results[name] = exc

    async with pool, tangram.Runtime(capacity=pool.capacity()), anyio.create_task_group() as tg:
        tg.start_soon(action, "first", [{"prompt": "a"}])
        await first.wait()
        tg.start_soon(action, "good", [{"prompt": "b"}, {"prompt": "c"}])
        tg.start_soon(action, "bad", [{"prompt": "d"}, {"text": 1}])
        replica = pool._services["judge"].replicas[0]
        await wait_until(lambda: len(replica.pending) == 2)
        gate.set()
    assert results["first"] == [{"text": "A"}]
    assert results["good"] == [{"text": "B"}, {"text": "C"}]
    error = results["bad"]
    assert isinstance(error, GpuServiceError)
    assert "400" in str(error) and "TaskGroup" not in str(error), error
