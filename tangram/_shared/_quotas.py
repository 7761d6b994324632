"""A job's API quotas: admitted, sent and adapted by the job's scheduler, for every worker.

A :class:`tangram.quota.Quota` decides from a runtime of its own process: which key has
budget soonest (the ledger's levels), and how far to cut a key's rates when the provider
refuses (AIMD, through ``set_capacity``). A ``[quota.NAME]`` limit is the provider's, for
the whole job: eight workers each running a ``Quota`` of their own would each send at the
full rate, and each would cut its rates to what it alone saw accepted. So in shared mode
the quota runs once, in the job's scheduler (the Ray actor, or without Ray the node's
scheduler process), on that scheduler's runtime, and a worker's ``quota.client()`` hands
it each request: the scheduler picks the key, waits for its budget, sends, retries, and
answers with the provider's response, its body read whole. That is one message per API
request to the job's scheduler; a job's API requests are bounded by its provider's rate,
far below what one scheduler answers a second (``benchmarks/ray_ceiling.py``). Per-node
leases of a quota, which would keep even those messages on the node, are not built.

A worker cancelled while its request waits or is in flight says so, and the scheduler
cancels the request there, so its slot comes back at once. So it does for a worker that
dies mid-request: at once without Ray (its connection drops, and the call with it), and
on Ray when the worker's proxy is dropped, a lease timeout after its last heartbeat.
The body travels by value both ways; what is a callable of this process (a ``trace``
extension, a ``transport=`` to wrap) cannot travel and is refused at the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import pickle
import resource
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from .._core._validate import real
from ..errors import InvalidSettingError, QuotaDeadlineError, SchedulerUnavailableError
from ._protocol import lost, task_failed

if TYPE_CHECKING:
    from .._quota._keys import KeyStats
    from .._quota._quota import Quota
    from .._runtime._run import Runtime
    from ._proxy import RemoteRuntime

__all__ = ["JobQuota", "QuotaDesk"]

#: The request extensions that travel with a request: tangram's own (tokens, deadline,
#: idempotent) and httpx's timeouts, all plain values.
_EXTENSIONS = ("tangram.tokens", "tangram.deadline", "tangram.idempotent", "timeout")
#: And with a response: what the provider said besides its status and headers.
_ANSWERED = ("reason_phrase", "http_version")
#: ``client()`` settings of the connection, which the job's scheduler makes: refused, not
#: silently dropped (httpx ignores them beside a transport of its caller's).
_CONNECTION = ("transport", "mounts", "verify", "cert", "http1", "http2", "limits", "proxy")
#: Seconds a cancellation that came before its request is kept for it: far past any
#: delivery delay between one caller's two calls, and it bounds what the book holds.
_FORGET = 300.0
#: Connections the scheduler opens to providers at most: past httpx's 100 (requests the
#: quota admitted failed on its pool), and never so many that the process, which also
#: answers every worker's heartbeats, runs out of files (see ``_connections``).
_MOST_CONNECTIONS = 4096

Spec = tuple[list[dict[str, Any]], dict[str, Any]]  # (keys, options) of one [quota.NAME]
Headers = list[tuple[bytes, bytes]]  # raw, as sent: a header need not be ASCII
Wire = tuple[str, str, Headers, bytes, dict[str, Any]]
#: Call ids of this process's requests, every quota's (see ``JobQuota``).
_CALLS = itertools.count(1)


class QuotaDesk:
    """The scheduler's side: the job's quotas on its runtime, sending for every worker."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._quotas: dict[str, tuple[Spec, Quota]] = {}
        self._configured: dict[str, object] = {}
        self._transport: httpx.AsyncHTTPTransport | None = None
        self._calls: dict[str, asyncio.Task[Any]] = {}
        # Calls cancelled before their request arrived (an actor runs one caller's calls
        # in any order), with when: the request, when it comes, is answered as cancelled
        # at once. A cancellation that crossed its answer is never claimed: forgotten
        # after ``_FORGET`` seconds.
        self._cancelled: dict[str, float] = {}

    def open(self, name: str, keys: list[dict[str, Any]], options: dict[str, Any]) -> None:
        """Build quota ``name`` here, once: later workers must state the same keys.

        :raises InvalidSettingError: another worker stated other keys or options for it.
        """
        from .._quota._keys import ApiKey
        from .._quota._quota import Quota

        spec: Spec = (keys, options)
        known = self._quotas.get(name)
        if known is not None:
            if known[0] != spec:
                raise InvalidSettingError(
                    f"[quota.{name}] differs from the one the job's scheduler was given by "
                    "the first worker: every worker of a job must state the same quotas"
                )
            return
        quota = Quota([ApiKey(**k) for k in keys], name=name, runtime=self._runtime, **options)
        self._configured.update(quota.capacity())  # before AIMD changes any rate
        quota._attach()  # its kinds are the job's from now on, as a first request makes them
        self._quotas[name] = (spec, quota)

    def configured(self) -> dict[str, object]:
        """The quotas' kinds as configured: AIMD changes the runtime's rates, not these."""
        return dict(self._configured)

    def stats(self, name: str) -> dict[str, KeyStats]:
        return self._quotas[name][1].stats()

    async def send(self, name: str, call: str, wire: Wire) -> tuple[Any, ...]:
        """One worker's request, sent under quota ``name``: the answer, or what it raised.

        Answered as ``("ok", status, headers, raw body, extensions, stats)``,
        ``("raised", error, stats)`` or ``("cancelled",)``: errors travel as values, so
        that an httpx error reaches the worker as the same class, not as the transport's
        failure.
        """
        if self._cancelled.pop(call, None) is not None:
            return ("cancelled",)
        task = asyncio.ensure_future(self._send(name, wire))
        self._calls[call] = task
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            # This call itself was cancelled (the socket's caller hung up, the scheduler
            # closes): the request goes with it, and its slot.
            task.cancel()
            raise
        finally:
            self._calls.pop(call, None)
        if task.cancelled():
            return ("cancelled",)
        stats = self.stats(name)
        error = task.exception()
        if error is not None:
            return ("raised", _portable(error), stats)
        status, headers, raw, answered = task.result()
        return ("ok", status, headers, raw, answered, stats)

    async def _send(self, name: str, wire: Wire) -> tuple[int, Headers, bytes, dict[str, Any]]:
        method, url, headers, content, extensions = wire
        if self._transport is None:
            most = _connections()
            limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
            self._transport = httpx.AsyncHTTPTransport(limits=limits)
        request = httpx.Request(method, url, headers=headers, content=content)
        request.extensions.update(extensions)
        # A request waits for a connection within its deadline, never failing on the
        # pool: a PoolTimeout would count against its key as the provider's failure.
        request.extensions["timeout"] = {**extensions.get("timeout", {}), "pool": None}
        response = await self._quotas[name][1].send(request, self._transport)
        try:
            # Raw, as the provider encoded it: the worker's client decodes it by the
            # headers, which say the encoding it asked for.
            raw = b"".join([chunk async for chunk in response.aiter_raw()])
        finally:
            await response.aclose()  # the request's slot is given back here
        answered = {k: response.extensions[k] for k in _ANSWERED if k in response.extensions}
        return response.status_code, list(response.headers.raw), raw, answered

    def drop(self, client: str) -> None:
        """The worker ``client`` is gone (silent past the lease timeout, or left): its
        requests end here too, and their slots come back."""
        for call, task in list(self._calls.items()):
            if call.startswith(f"{client}-"):
                task.cancel()

    def cancel(self, call: str) -> None:
        task = self._calls.get(call)
        if task is not None:
            task.cancel()
            return
        now = time.monotonic()
        for old, at in list(self._cancelled.items()):
            if now - at > _FORGET:
                del self._cancelled[old]
        self._cancelled[call] = now

    async def aclose(self) -> None:
        for task in list(self._calls.values()):
            task.cancel()
        if self._transport is not None:
            await self._transport.aclose()


def _connections() -> int:
    """How many connections the scheduler may open: half its open files, with its soft
    limit raised to the hard one first, and ``_MOST_CONNECTIONS`` at most. A flood of
    requests to a slow provider on a key without a concurrency limit had every file of
    the process in use, and its heartbeats' sockets failed with them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY:
        return _MOST_CONNECTIONS
    return max(16, min(_MOST_CONNECTIONS, soft // 2))


def _portable(error: BaseException) -> tuple[str, Any]:
    """``error`` as it can travel: httpx's by class name and message (they hold the
    request, which does not), others whole where they pickle."""
    if isinstance(error, httpx.HTTPError):
        return ("httpx", (type(error).__name__, str(error)))
    try:
        # Loaded back too: an error that pickles but cannot be rebuilt (httpx's
        # StreamConsumed) would fail in the worker as the scheduler's own failure.
        pickle.loads(pickle.dumps(error))
    except Exception:
        return ("other", f"{type(error).__name__}: {error}")
    return ("pickled", error)


def _rebuilt(portable: tuple[str, Any], request: httpx.Request) -> BaseException:
    how, value = portable
    if how == "pickled":
        return value  # type: ignore[no-any-return]
    if how == "httpx":
        name, message = value
        cls = getattr(httpx, name, None)
        if isinstance(cls, type) and issubclass(cls, httpx.RequestError):
            return cls(message, request=request)
        return httpx.TransportError(message, request=request)
    return SchedulerUnavailableError(f"the job's scheduler failed this API request: {value}")


class JobQuota:
    """``resources.quota(name)`` in shared mode: a Quota's ``client()`` and ``stats()``,
    each request admitted and sent by the job's scheduler under the job's limits."""

    def __init__(
        self,
        remote: RemoteRuntime,
        name: str,
        keys: Sequence[Mapping[str, Any]],
        options: Mapping[str, Any],
    ) -> None:
        self.name = name
        self._actor = remote.actor
        self._spec: Spec = ([dict(k) for k in keys], dict(options))
        self._opened = False
        self._stats: dict[str, KeyStats] = {}
        # Call ids unique across the job (pids repeat across nodes and containers), and
        # the proxy's: the scheduler ends a worker's requests when it drops the worker.
        # Numbered by one count for the process: each quota counting its own, a worker's
        # two quotas sent two calls of one id, and cancelling one cancelled the other.
        self._prefix = f"{remote.client_id}-"
        self._remote = remote

    def __repr__(self) -> str:
        return f"<tangram job quota {self.name!r}>"

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` whose every request goes through the job's quota.

        Keyword arguments go to ``httpx.AsyncClient``, as for
        :meth:`tangram.quota.Quota.client`.

        :raises InvalidSettingError: a setting of the connection (``transport=``,
            ``verify=``, ``limits=``, ``http2=`` ...): the job's scheduler makes the
            connections.
        """
        refused = sorted(k for k in kwargs if k in _CONNECTION)
        if refused:
            raise InvalidSettingError(
                f"quota {self.name!r} is the job's (mode = 'shared'): its scheduler sends "
                f"the requests over connections of its own, so {', '.join(refused)} cannot "
                "be set here; use mode = 'local' for a quota of this process"
            )
        return httpx.AsyncClient(transport=_JobTransport(self), **kwargs)

    def stats(self) -> dict[str, KeyStats]:
        """Each key's figures as of this process's latest answer (the job's, all workers'):
        zeros before its first, as a Quota that has sent nothing."""
        if not self._stats:
            from .._quota._keys import KeyStats

            return {k["name"]: KeyStats(0, 0, 0, 0, 0, False, 1.0) for k in self._spec[0]}
        return dict(self._stats)

    async def _open(self) -> None:
        if self._opened:
            return
        try:
            await self._actor.quota_open.remote(self.name, *self._spec)
        except task_failed() as exc:
            raise exc.cause from exc
        except lost() as exc:
            raise SchedulerUnavailableError(f"the job's scheduler is unreachable: {exc}") from exc
        self._opened = True

    async def send(self, request: httpx.Request) -> httpx.Response:
        if "trace" in request.extensions:
            raise InvalidSettingError(
                "a request's `trace` extension is a function of this process, and the job's "
                f"scheduler sends quota {self.name!r}'s requests: leave it out"
            )
        await self._open()
        content = await request.aread()
        extensions = {k: request.extensions[k] for k in _EXTENSIONS if k in request.extensions}
        wire: Wire = (
            request.method,
            str(request.url),
            list(request.headers.raw),
            content,
            extensions,
        )
        call = f"{self._prefix}{next(_CALLS)}"
        pending = self._actor.quota_send.remote(self.name, call, wire)
        # The scheduler answers a request past its deadline with QuotaDeadlineError; one
        # that answers nothing (its loop blocked) is given a heartbeat beyond it, then the
        # same error is raised here.
        # (A deadline that is no number is the scheduler's to refuse, typed.)
        from .._quota._quota import DEADLINE_EXTENSION, DEFAULT_DEADLINE

        default = self._spec[1].get("deadline", DEFAULT_DEADLINE)
        deadline = request.extensions.get(DEADLINE_EXTENSION, default)
        limit = math.inf
        if isinstance(deadline, (int, float)) and not isinstance(deadline, bool):
            limit = max(0.0, real(deadline)) + self._remote._heartbeat
        try:
            with anyio.move_on_after(limit) as waited:
                answer = await pending
        except task_failed() as exc:
            raise SchedulerUnavailableError(
                f"the job's scheduler failed quota {self.name!r}'s request: {exc}"
            ) from exc
        except lost() as exc:
            raise SchedulerUnavailableError(f"the job's scheduler is unreachable: {exc}") from exc
        except BaseException:
            with contextlib.suppress(*lost()):
                self._actor.quota_cancel.remote(call)
            raise
        if waited.cancelled_caught:
            with contextlib.suppress(*lost()):
                self._actor.quota_cancel.remote(call)
            raise QuotaDeadlineError(
                f"the job's scheduler did not answer quota {self.name!r}'s request within its "
                f"deadline of {deadline} s and a heartbeat after it"
            )
        if answer[0] == "cancelled":
            raise SchedulerUnavailableError(
                f"the job's scheduler cancelled quota {self.name!r}'s request: it is closing, "
                "or it heard no heartbeat of this process for longer than the lease timeout"
            )
        self._stats = answer[-1]
        if answer[0] == "raised":
            raise _rebuilt(answer[1], request)
        _, status, headers, raw, answered, _ = answer
        stream = httpx.ByteStream(raw)
        return httpx.Response(
            status, headers=headers, stream=stream, request=request, extensions=answered
        )


class _JobTransport(httpx.AsyncBaseTransport):
    def __init__(self, quota: JobQuota) -> None:
        self._quota = quota

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._quota.send(request)
