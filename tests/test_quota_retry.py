"""What the quota client resends, how long a call may last, and where its retry lines go.

Against the real loopback :class:`~tangram.testing.QuotaServer` (and, for connections that
fail before anything is sent, a port nobody listens on), counting on the server's side how
often each request arrived: a paid judge call answered ``500`` or timing out must reach
the server once unless the caller said a resend is safe.
"""

from __future__ import annotations

import logging
import math
import socket
import subprocess
import sys
import textwrap
from contextlib import AsyncExitStack

import anyio
import httpx
import pytest
import trio.testing

import tangram
from tangram._quota._retry import may_resend
from tangram.quota import DEFAULT_DEADLINE, ApiKey, Quota, QuotaDeadlineError, Retry
from tangram.testing import Limit, QuotaServer

pytestmark = pytest.mark.anyio

_FAST = Retry(attempts=3, wait_initial=0.001, wait_max=0.01, wait_jitter=0.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Recording(httpx.AsyncBaseTransport):
    """httpx's own transport, keeping each attempt's request as it went out."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.sent: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _quota(retry: Retry = _FAST, **options: object) -> Quota:
    key = ApiKey(name="k", requests=200, headers={"Authorization": "Bearer k"})
    return Quota([key], retry=retry, adapt=None, **options)  # type: ignore[arg-type]


async def _client(
    stack: AsyncExitStack, quota: Quota, url: str, **options: object
) -> tuple[tangram.Runtime, httpx.AsyncClient]:
    runtime = await stack.enter_async_context(tangram.Runtime(capacity=quota.capacity()))
    client = await stack.enter_async_context(quota.client(base_url=url, **options))
    return runtime, client


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- the rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "method", "marked", "expected"),
    [
        ("unknown", "POST", None, False),
        ("unknown", "PATCH", None, False),
        ("unknown", "GET", None, True),
        ("unknown", "HEAD", None, True),
        ("unknown", "OPTIONS", None, True),
        ("unknown", "TRACE", None, True),
        ("unknown", "PUT", None, True),
        ("unknown", "DELETE", None, True),
        ("unknown", "POST", True, True),
        ("unknown", "GET", False, False),
        ("refused", "POST", None, True),
        ("refused", "POST", False, True),
        ("unsent", "POST", None, True),
        ("unsent", "PATCH", False, True),
    ],
)
def test_what_may_be_resent(outcome: str, method: str, marked: bool | None, expected: bool) -> None:
    assert may_resend(outcome, method, marked=marked) is expected  # type: ignore[arg-type]


def test_the_methods_setting_widens_the_rule() -> None:
    methods = Retry(methods={"get", "post"}).methods
    assert methods == frozenset({"GET", "POST"})
    assert may_resend("unknown", "POST", marked=None, methods=methods)
    assert not may_resend("unknown", "PUT", marked=None, methods=methods)


# -- what reaches the server -------------------------------------------------------------


async def test_a_post_answered_500_is_sent_once_and_a_get_is_retried() -> None:
    quota = _quota()
    async with QuotaServer(Limit(), failing={"k"}) as server, AsyncExitStack() as stack:
        _, client = await _client(stack, quota, server.url)
        assert (await client.post("/v1", json={"judge": 1})).status_code == 500
        assert len(server.failed) == 1
        answered = await client.get("/v1")
        assert answered.status_code == 500
        assert len(server.failed) == 1 + _FAST.attempts
    # What the last attempt got, body and all: it was dropped, under a Content-Length that
    # still counted it, and a provider's error text is what its caller debugs from.
    assert answered.json() == {"error": "key failing"}
    assert int(answered.headers["content-length"]) == len(answered.content)


async def test_a_post_whose_reply_times_out_is_sent_once_and_a_get_is_retried() -> None:
    quota = _quota()
    slow = {"X-Delay": "30"}
    async with QuotaServer(Limit()) as server, AsyncExitStack() as stack:
        _, client = await _client(stack, quota, server.url, timeout=0.3)
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1", headers=slow, json={"judge": 1})
        assert len(server.accepted) == 1
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/v1", headers=slow)
        assert len(server.accepted) == 1 + _FAST.attempts


async def test_a_post_marked_idempotent_is_retried_and_a_get_marked_not_is_not() -> None:
    quota = _quota()
    async with QuotaServer(Limit(), failing={"k"}) as server, AsyncExitStack() as stack:
        _, client = await _client(stack, quota, server.url)
        marked = {"tangram.idempotent": True}
        assert (await client.post("/v1", extensions=marked)).status_code == 500
        assert len(server.failed) == _FAST.attempts
        unmarked = {"tangram.idempotent": False}
        assert (await client.get("/v1", extensions=unmarked)).status_code == 500
        assert len(server.failed) == _FAST.attempts + 1


async def test_a_post_with_the_callers_idempotency_key_is_retried_with_that_key() -> None:
    quota = _quota()
    recording = _Recording()
    async with QuotaServer(Limit(), failing={"k"}) as server, AsyncExitStack() as stack:
        _, client = await _client(stack, quota, server.url, transport=recording)
        response = await client.post("/v1", headers={"Idempotency-Key": "judge-7"})
        assert response.status_code == 500
    assert len(server.failed) == _FAST.attempts
    assert [r.headers["Idempotency-Key"] for r in recording.sent] == ["judge-7"] * 3


async def test_a_client_that_adds_idempotency_keys_retries_posts_under_one_key() -> None:
    quota = _quota(retry=Retry(attempts=3, wait_initial=0.001, idempotency_key=True))
    recording = _Recording()
    async with QuotaServer(Limit(), failing={"k"}) as server, AsyncExitStack() as stack:
        _, client = await _client(stack, quota, server.url, transport=recording)
        assert (await client.post("/v1")).status_code == 500
        assert (await client.post("/v1")).status_code == 500
        assert (await client.get("/v1")).status_code == 500
    assert len(server.failed) == 9
    first, second = (
        {r.headers["Idempotency-Key"] for r in recording.sent[i : i + 3]} for i in (0, 3)
    )
    assert len(first) == len(second) == 1 and first != second
    # GET is idempotent as it stands: it gets no key.
    assert all("Idempotency-Key" not in r.headers for r in recording.sent[6:])


@pytest.mark.parametrize("refuse_with", [429, 503])
async def test_a_refused_post_is_retried(refuse_with: int) -> None:
    # The server allows 2/s, the client believes 200/s: the second POST is refused with
    # 429 (or 503 with Retry-After), which says the work was not done, so it is sent
    # again and succeeds.
    quota = _quota(retry=Retry(attempts=8, wait_initial=0.01))
    async with (
        QuotaServer(Limit(requests=2, requests_burst=1), refuse_with=refuse_with) as server,
        AsyncExitStack() as stack,
    ):
        _, client = await _client(stack, quota, server.url)
        for _ in range(2):
            assert (await client.post("/v1")).status_code == 200
    assert len(server.rejected) >= 1
    assert len(server.accepted) == 2


async def test_a_post_that_never_connected_is_retried() -> None:
    quota = _quota()
    recording = _Recording()
    async with AsyncExitStack() as stack:
        url = f"http://127.0.0.1:{_closed_port()}"
        _, client = await _client(stack, quota, url, transport=recording)
        with pytest.raises(httpx.ConnectError):
            await client.post("/v1")
        assert quota.stats()["k"].in_flight == 0
    assert len(recording.sent) == _FAST.attempts


# -- how long a call may last ------------------------------------------------------------


def test_the_default_deadline_is_finite() -> None:
    assert math.isfinite(DEFAULT_DEADLINE)
    assert _quota().deadline == DEFAULT_DEADLINE
    assert _quota(deadline=None).deadline is None


async def test_a_huge_retry_after_fails_at_once_under_the_default_deadline() -> None:
    # After one request, the server's bucket refills in 1e5 s: it says so in Retry-After.
    quota = _quota(retry=Retry(attempts=8))
    async with (
        QuotaServer(Limit(requests=1e-5, requests_burst=1)) as server,
        AsyncExitStack() as stack,
    ):
        runtime, client = await _client(stack, quota, server.url)
        assert (await client.get("/v1")).status_code == 200
        with anyio.fail_after(10):
            with pytest.raises(QuotaDeadlineError) as refused:
                await client.get("/v1")
            with pytest.raises(QuotaDeadlineError) as known:
                await client.get("/v1")
        assert runtime.stats().waiting == 0
    assert "1e+05 s" in str(refused.value) and f"{DEFAULT_DEADLINE:g} s" in str(refused.value)
    assert "1e+05 s" in str(known.value) and f"{DEFAULT_DEADLINE:g} s" in str(known.value)
    # The second call knew the key's pause and sent nothing.
    assert len(server.rejected) == 1


async def test_a_hung_server_is_bounded_by_the_deadline_and_returns_the_slot() -> None:
    quota = Quota([ApiKey(name="k", concurrency=1)], deadline=0.5, adapt=None)
    async with QuotaServer(Limit(), latency=3600) as server, AsyncExitStack() as stack:
        runtime, client = await _client(stack, quota, server.url, timeout=None)
        with anyio.fail_after(10), pytest.raises(QuotaDeadlineError) as caught:
            await client.post("/v1")
        assert runtime.stats().resources["api.k.concurrency"].held == 0
        assert quota.stats()["k"].in_flight == 0
    assert "0.5 s" in str(caught.value) and "POST" in str(caught.value)
    assert len(server.accepted) == 1


# Jump only once every task has been idle for 0.1 real seconds: loopback I/O lands well
# within it, so the clock does not jump past the request while it is on the wire.
@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0.1)})]
)
async def test_the_default_deadline_bounds_a_hung_server_on_virtual_time() -> None:
    """On trio's virtual clock the default's 600 s pass at once; the server never answers."""
    quota = Quota([ApiKey(name="k", concurrency=1)], adapt=None)
    async with (
        QuotaServer(Limit(), latency=10 * DEFAULT_DEADLINE) as server,
        AsyncExitStack() as stack,
    ):
        runtime, client = await _client(stack, quota, server.url, timeout=None)
        started = anyio.current_time()
        with pytest.raises(QuotaDeadlineError):
            await client.post("/v1")
        assert anyio.current_time() - started == pytest.approx(DEFAULT_DEADLINE, abs=1.0)
        assert runtime.stats().resources["api.k.concurrency"].held == 0
    assert len(server.accepted) <= 1


# -- where retry lines go ----------------------------------------------------------------


async def test_retry_lines_go_to_the_tangram_quota_logger(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    quota = _quota()
    async with QuotaServer(Limit(), failing={"k"}) as server, AsyncExitStack() as stack:
        _, client = await _client(stack, quota, server.url)
        await client.get("/v1?q=secret")
        await client.post("/v1")
    ours = [r for r in caplog.records if r.name == "tangram.quota"]
    retried = [r for r in ours if r.getMessage().startswith("retrying")]
    assert [(r.levelno, r.method, r.attempt) for r in retried] == [  # type: ignore[attr-defined]
        (logging.INFO, "GET", 1),
        (logging.INFO, "GET", 2),
    ]
    first = retried[0]
    assert first.key == "k" and first.status == 500 and first.attempts == 3  # type: ignore[attr-defined]
    assert first.wait >= 0  # type: ignore[attr-defined]
    assert "secret" not in first.getMessage() and "secret" not in first.url  # type: ignore[attr-defined]
    not_resent = [r for r in ours if r not in retried]
    assert len(not_resent) == 1 and "POST" in not_resent[0].getMessage()
    assert "idempotent" in not_resent[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("stamina")]
    assert capsys.readouterr().err == ""


async def test_a_refusal_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tangram.quota")
    quota = _quota(retry=Retry(attempts=8, wait_initial=0.01))
    async with (
        QuotaServer(Limit(requests=2, requests_burst=1)) as server,
        AsyncExitStack() as stack,
    ):
        _, client = await _client(stack, quota, server.url)
        for _ in range(2):
            await client.get("/v1")
    refusals = [r for r in caplog.records if getattr(r, "status", None) == 429]
    assert refusals and all(r.levelno == logging.DEBUG for r in refusals)


def test_nothing_is_printed_when_the_application_configured_no_logging() -> None:
    """A fresh interpreter, as a rollout worker starts: Python prints warnings that no
    handler takes (``logging.lastResort``), which is how stamina's retry lines showed."""
    script = textwrap.dedent(
        """
        import anyio, tangram
        from tangram.quota import ApiKey, Quota, Retry
        from tangram.testing import Limit, QuotaServer

        async def main():
            key = ApiKey(name="k", requests=100, headers={"Authorization": "Bearer k"})
            quota = Quota([key], retry=Retry(attempts=3))
            async with QuotaServer(Limit(), failing={"k"}) as server:
                async with tangram.Runtime(capacity=quota.capacity()):
                    async with quota.client(base_url=server.url) as client:
                        assert (await client.get("/v1")).status_code == 500
                        assert (await client.post("/v1")).status_code == 500
                assert len(server.failed) == 4, server.failed

        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout == ""
