"""API quotas: rate and concurrency limits per key, keys pooled, behind a plain httpx client.

A provider's quota is two resource kinds the core already schedules: a *rate* (requests or
tokens per second, a token bucket with a burst) taken at admission and never given back,
and a *count* (concurrent requests) held while the request is in flight. Each key of a
:class:`Quota` becomes up to three kinds in the runtime (``"<quota>.<key>.requests"``,
``".tokens"``, ``".concurrency"``), so quota admissions share one queue, one policy and one
set of stats with every other action of the rollout.

What this layer adds on top of the core, one module each:

- **Keys as one pool** (:mod:`._keys`). Each request goes to the key whose budgets let it
  start soonest (ties go to the key that has sent least, which keeps keys in balance).
- **Token estimates, corrected** (here). A request takes its *estimated* tokens at
  admission. When ``count_tokens`` reads the real count from the response and it is
  larger, the difference is taken from the same budget before the response is handed back
  (the caller that overspent waits, nobody else does), so the long-run token rate is
  exact. A smaller real count is *not* credited back: the core's token buckets only ever
  give units out, and an over-estimate costs throughput, never a ``429``.
- **429 and 503.** ``Retry-After`` (or the more precise ``retry-after-ms``) pauses the key
  for that long; the request is retried (:mod:`._retry`; on another key when one is
  ready); the key measures what the provider accepts while it refuses,
  cuts its rates just under that and grows back to hold there (AIMD, :mod:`._adapt`,
  through :meth:`tangram.Runtime.set_capacity`), so a configured limit above the
  provider's real one converges just below it (and one below it, with
  ``Adapt(above=...)``, probes up to it).
- **Keys that keep failing** (transport errors, ``5xx``) are set aside for a cool-down
  that doubles on each repeat, then given one probe request (:mod:`._aside`).
- **Only what is safe is resent** (:mod:`._retry`): a ``5xx`` or a timed-out reply may
  have been served, so only idempotent methods, or requests their caller marks, are sent
  again; refusals and connections that never opened are retried whatever the method.
- **Deadlines, finite by default, fail fast** (here). Each call must be answered within
  its deadline (:data:`DEFAULT_DEADLINE`), waits and retries included, so a hung server or
  a ``Retry-After`` of hours ends in :class:`QuotaDeadlineError`; a request whose key
  cannot start it before then raises at once instead of waiting to time out.

Cancellation at any point returns the request's slot: slots are leases of the core and
every path out of a request exits them (the response stream holds its slot until the body
is closed: :mod:`._transport`).
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import httpx

from .._core._validate import number, seconds
from .._runtime._run import AcquireContext, Runtime, current_local_runtime
from ..errors import (
    DemandTypeError,
    InvalidCapacityError,
    InvalidDemandError,
    QuotaDeadlineError,
    SettingTypeError,
)
from ._adapt import Adapt, adapt_down, adapt_up, note_accepted
from ._aside import SetAside, note_failure, note_recovered
from ._keys import (
    DEFAULT_HEADROOM,
    DEFAULT_JITTER,
    SETTING_ERRORS,
    ApiKey,
    KeyState,
    KeyStats,
    choose,
    ready_in,
)
from ._retry import (
    IDEMPOTENCY_HEADER,
    LIMITED,
    METHOD,
    Again,
    Deadline,
    Outcome,
    Retry,
    closed,
    retry_after,
    retrying,
)
from ._transport import QuotaTransport, ReleasingStream, outgoing

__all__ = [
    "DEADLINE_EXTENSION",
    "DEFAULT_DEADLINE",
    "IDEMPOTENT_EXTENSION",
    "TOKENS_EXTENSION",
    "Quota",
]

#: Request extension keys a caller may set per request (``extensions={...}`` in httpx).
TOKENS_EXTENSION = "tangram.tokens"
DEADLINE_EXTENSION = "tangram.deadline"
#: ``True``: this request may be resent after a ``5xx`` or a timeout; ``False``: never.
IDEMPOTENT_EXTENSION = "tangram.idempotent"
#: Seconds a call may take by default, from the call to its answer's headers, waits and
#: retries included. The default request timeout of the OpenAI and Anthropic Python SDKs:
#: the longest a provider's own client waits for one call (a long generation by a
#: reasoning judge), so it cuts no call that a provider's client would let finish, and a
#: hung server or a ``Retry-After`` of hours costs a rollout 10 minutes, not the run.
DEFAULT_DEADLINE = 600.0
#: Connection failures raised before any byte of the request was written: nothing reached
#: the server, so the request is resent whatever its method.
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: ``Quota(adapt=...)`` by default: AIMD on, with its default settings.
_ADAPT = Adapt()


class Quota:
    """A provider's quota over one or more keys, scheduled by a :class:`tangram.Runtime`.

    ``quota.client()`` is an ``httpx.AsyncClient`` that takes a slot and budget for every
    request; everything else is plain httpx. Build it at configuration time; it attaches
    to the current runtime (or ``runtime``) on first use, adding its kinds if the runtime
    was not built with :meth:`capacity`.

    :param keys: the keys; requests spread over them.
    :param name: prefixes the resource kinds (two quotas need two names).
    :param headroom: share of each configured rate actually used (see
        :data:`DEFAULT_HEADROOM`).
    :param jitter: seconds by which requests may reach the provider out of step with
        their admission; the client's burst is the provider's less ``rate * jitter``
        (see :data:`DEFAULT_JITTER`). When the provider's burst is smaller than that,
        the client sends one request at a time at the (headroom-scaled) rate.
    :param estimate_tokens: tokens a request will cost, before it is sent; a request's
        ``extensions={"tangram.tokens": n}`` overrides it. Default: none.
    :param count_tokens: the real cost from the response (its body is read first); the
        difference to the estimate is charged (see the module docstring).
    :param deadline: seconds a call may take until its answer's headers, waits and
        retries included (:data:`DEFAULT_DEADLINE`), or ``None`` for no limit; a
        request's ``extensions={"tangram.deadline": s}`` overrides it.
    :param retry: how often and which requests to retry (:class:`Retry`); a request's
        ``extensions={"tangram.idempotent": True}`` (or an ``Idempotency-Key`` header)
        marks it safe to resend after a ``5xx`` or a timeout.
    :param adapt: AIMD settings, or ``None`` to trust the configured rates.
    :raises InvalidCapacityError: an argument out of range (``keys=[]``, ``headroom=2``).
    :raises SettingTypeError: an argument of the wrong type (``keys="k"``, ``headroom="x"``).
    """

    def __init__(
        self,
        keys: Sequence[ApiKey],
        *,
        name: str = "api",
        headroom: float = DEFAULT_HEADROOM,
        jitter: float = DEFAULT_JITTER,
        estimate_tokens: Callable[[httpx.Request], float] | None = None,
        count_tokens: Callable[[httpx.Response], float | None] | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
        retry: Retry | None = None,
        adapt: Adapt | None = _ADAPT,
        set_aside: SetAside | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        message = f"`keys` must be a non-empty list of ApiKey (got {keys!r})"
        if isinstance(keys, (str, bytes, ApiKey)) or not isinstance(keys, Sequence):
            raise SettingTypeError(message)
        keys = list(keys)
        if not all(isinstance(k, ApiKey) for k in keys):
            raise SettingTypeError(message)
        if not keys:
            raise InvalidCapacityError(message)
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise InvalidCapacityError(f"key names must be unique within a quota (got {names!r})")
        if not isinstance(name, str):
            raise SettingTypeError(f"`name` must be a non-empty string (got {name!r})")
        if not name:
            raise InvalidCapacityError(f"`name` must be a non-empty string (got {name!r})")
        share = number("headroom", headroom, strict=True, maximum=1.0, **SETTING_ERRORS)
        spread = seconds("jitter", jitter, **SETTING_ERRORS)
        if deadline is not None:
            seconds("deadline", deadline, strict=True, finite=False, **SETTING_ERRORS)
        functions = (("estimate_tokens", estimate_tokens), ("count_tokens", count_tokens))
        for what, function in functions:
            if function is not None and not callable(function):
                raise SettingTypeError(
                    f"`{what}` must be a function of the request or response (got {function!r})"
                )
        for what, setting, kind in (
            ("retry", retry, Retry),
            ("adapt", adapt, Adapt),
            ("set_aside", set_aside, SetAside),
            ("runtime", runtime, Runtime),
        ):
            if setting is not None and not isinstance(setting, kind):
                raise SettingTypeError(
                    f"`{what}` must be a {kind.__qualname__} or None (got {setting!r})"
                )
        self.name = name
        self.estimate_tokens = estimate_tokens
        self.count_tokens = count_tokens
        self.deadline = deadline
        self.retry = retry if retry is not None else Retry()
        self.adapt = adapt
        self.set_aside = set_aside if set_aside is not None else SetAside()
        self._runtime = runtime
        self.jitter = spread
        self._keys = [KeyState(name, key, share, spread) for key in keys]

    def __repr__(self) -> str:
        return f"<tangram.quota.Quota {self.name!r} keys={[k.key.name for k in self._keys]!r}>"

    # -- configuration -----------------------------------------------------------------

    def capacity(self) -> dict[str, object]:
        """The resource kinds this quota needs, to merge into ``Runtime(capacity=...)``."""
        capacity: dict[str, object] = {}
        for key in self._keys:
            capacity.update(key.rates())
            if key.slots_kind is not None and key.key.concurrency is not None:
                capacity[key.slots_kind] = key.key.concurrency
        return capacity

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` whose every request goes through this quota.

        Keyword arguments go to ``httpx.AsyncClient`` (``base_url``, ``timeout`` ...);
        ``transport=`` is wrapped, not replaced.
        """
        inner = kwargs.pop("transport", None)
        return httpx.AsyncClient(transport=QuotaTransport(self, inner), **kwargs)

    def stats(self) -> dict[str, KeyStats]:
        now = anyio.current_time()
        return {k.key.name: k.stats(now) for k in self._keys}

    # -- scheduling --------------------------------------------------------------------

    def _attach(self) -> Runtime:
        runtime = self._runtime if self._runtime is not None else current_local_runtime("a Quota")
        capacity = runtime.capacity
        missing = {kind: v for kind, v in self.capacity().items() if kind not in capacity}
        if missing:
            runtime.set_capacity(missing)
        return runtime

    def _deadline_of(self, request: httpx.Request) -> Deadline | None:
        value = request.extensions.get(DEADLINE_EXTENSION, self.deadline)
        if value is None:
            return None
        limit = seconds(
            f'extensions["{DEADLINE_EXTENSION}"]',
            value,
            strict=True,
            finite=False,
            type_error=DemandTypeError,
            value_error=InvalidDemandError,
        )
        return Deadline(anyio.current_time() + limit, limit)

    def _tokens_of(self, request: httpx.Request) -> float:
        value = request.extensions.get(TOKENS_EXTENSION)
        where = f'extensions["{TOKENS_EXTENSION}"]'
        if value is None and self.estimate_tokens is not None:
            value = self.estimate_tokens(request)
            where = "estimate_tokens(request)"
        if value is None:
            return 0.0
        return number(where, value, type_error=DemandTypeError, value_error=InvalidDemandError)

    def _marked(self, request: httpx.Request) -> bool | None:
        """The caller's word on resending (see :func:`._retry.may_resend`)."""
        value = request.extensions.get(IDEMPOTENT_EXTENSION)
        if value is not None and not isinstance(value, bool):
            raise DemandTypeError(
                f'extensions["{IDEMPOTENT_EXTENSION}"] must be True or False (got {value!r})'
            )
        if value is None and IDEMPOTENCY_HEADER in request.headers:
            return True
        return value

    async def _pay(self, runtime: Runtime, kind: str, amount: float) -> None:
        """Take ``amount`` more from a rate budget, in bursts it can hold."""
        burst = runtime.capacity[kind].burst
        while amount > 1e-9:
            part = min(amount, burst)
            async with runtime.acquire({kind: part}, kind=f"{self.name}.correction"):
                pass
            amount -= part

    async def send(
        self, request: httpx.Request, transport: httpx.AsyncBaseTransport
    ) -> httpx.Response:
        """Send ``request`` through ``transport`` under this quota, retrying as configured.

        :raises QuotaDeadlineError: it was not answered before its deadline.
        :raises InvalidDemandError: a request extension of tangram's is out of range.
        """
        if not METHOD.fullmatch(request.method):
            raise InvalidDemandError(
                f"the request's method must be an HTTP method like 'GET' or 'POST' "
                f"(got {request.method!r})"
            )
        runtime = self._attach()
        tokens = self._tokens_of(request)
        deadline = self._deadline_of(request)
        marked = self._marked(request)
        retry = self.retry
        if marked is None and retry.idempotency_key and request.method not in retry.methods:
            # The same key on every resend: that is what lets the server deduplicate.
            request.headers[IDEMPOTENCY_HEADER] = str(uuid.uuid4())
            marked = True
        await request.aread()  # a retry resends the body
        attempt = functools.partial(self._attempt, runtime, request, transport, tokens, deadline)
        if deadline is None:
            return await retrying(retry, request, marked, None, attempt)
        with anyio.move_on_after(deadline.left()):
            return await retrying(retry, request, marked, deadline, attempt)
        url = request.url.copy_with(query=None, fragment=None)
        raise QuotaDeadlineError(
            f"{request.method} {url} had no answer within its deadline of {deadline.limit:g} s "
            "(Quota(deadline=...) or the request's tangram.deadline extension)"
        )

    async def _attempt(
        self,
        runtime: Runtime,
        request: httpx.Request,
        transport: httpx.AsyncBaseTransport,
        tokens: float,
        deadline: Deadline | None,
    ) -> httpx.Response:
        while True:
            key, start = choose(runtime, self._keys, tokens)
            now = anyio.current_time()
            remaining = None if deadline is None else deadline.left()
            if remaining is not None and start > remaining:
                raise QuotaDeadlineError(
                    f"key {key.key.name!r} can start this request in {start:.3g} s "
                    f"(its pause or budget), past {deadline}"
                )
            if key.contact is not None:
                await self._await_contact(key, deadline)
                continue
            if key.paused_until > now:
                # Wait out the provider's Retry-After before taking budget, so the
                # requests held back by it are paced by the bucket when it ends, not
                # released together.
                await anyio.sleep(key.paused_until - now)
                continue
            first = not key.contacted
            if first:
                key.contact = anyio.Event()
            probe = key.aside_until > -math.inf
            key.probing = key.probing or probe
            try:
                adapt_up(self.adapt, runtime, key, now)
                need = key.need(tokens)
                capacity = runtime.capacity
                if any(need[kind] > capacity[kind].burst for kind in key.provider if kind in need):
                    # Larger than any request before and than AIMD's cut burst: raise it.
                    runtime.set_capacity(key.rates())
                context = runtime.acquire(need, kind=self.name, wait_timeout=remaining)
                for kind in key.waiting:
                    key.waiting[kind] += need.get(kind, 0.0)
                key.waiting_count += 1
                try:
                    await context.__aenter__()
                except TimeoutError as exc:
                    raise QuotaDeadlineError(
                        f"no slot on key {key.key.name!r} within {deadline}"
                    ) from exc
                finally:
                    for kind in key.waiting:
                        key.waiting[kind] -= need.get(kind, 0.0)
                    key.waiting_count -= 1
                if key.paused_until > anyio.current_time():
                    # The provider paused the key while this request queued: sending now
                    # would fire it together with everything else admitted meanwhile.
                    # The budget it took is lost, which errs on the safe side.
                    await context.__aexit__(None, None, None)
                    continue
                return await self._send_holding(
                    runtime, context, key, request, transport, tokens, deadline
                )
            finally:
                if probe:
                    key.probing = False
                if first:
                    event, key.contact = key.contact, None
                    if event is not None:
                        event.set()

    async def _await_contact(self, key: KeyState, deadline: Deadline | None) -> None:
        """Wait for the answer to a key's first request (see ``KeyState.contacted``)."""
        event = key.contact
        assert event is not None
        if deadline is None:
            await event.wait()
            return
        with anyio.move_on_after(deadline.left()):
            await event.wait()
        if not event.is_set():
            raise QuotaDeadlineError(
                f"key {key.key.name!r} had not answered its first request before "
                f"its deadline of {deadline.limit:g} s"
            )

    async def _send_holding(
        self,
        runtime: Runtime,
        context: AcquireContext,
        key: KeyState,
        request: httpx.Request,
        transport: httpx.AsyncBaseTransport,
        tokens: float,
        deadline: Deadline | None,
    ) -> httpx.Response:
        """Send with the slot held; hand the slot to the response stream on success."""
        key.in_flight += 1
        handed_off = False
        admitted_at = anyio.current_time()
        # When its headers went out, which is when it reached the provider's bucket: AIMD
        # dates refusals and acceptances by it (admission when the transport says nothing).
        # Not the call into the transport: opening connections on a busy loop took up to a
        # second measured (150 requests at once), and dated by it every refusal looked
        # older than the cut it had caused.
        wrote: list[float] = []
        user_trace = request.extensions.get("trace")

        async def trace(name: str, info: dict[str, Any]) -> None:
            # The budget was taken at admission; a request held up before its first byte
            # (opening a connection on a busy loop: 40-60 ms measured, against 1-5 ms
            # usually) reaches the provider with requests admitted after it. Past a third
            # of the jitter allowance, take its budget again just before it goes out, so
            # that its send time, not its admission, obeys the bucket. Not for every new
            # connection: when many requests queue, a request waiting for budget a second
            # time holds its connection, others open more, and that cascade halved
            # throughput (186 connections for 200 requests).
            late = anyio.current_time() - admitted_at
            if name.endswith(".send_request_headers.started"):
                if late > self.jitter / 3:
                    await self._retake(runtime, key, tokens, deadline)
                wrote.append(anyio.current_time())
                key.sending.append(wrote[-1])
            if user_trace is not None:
                await user_trace(name, info)

        try:
            sending = outgoing(request, key, trace)
            key.sent += 1
            sent_at = anyio.current_time()
            try:
                response = await transport.handle_async_request(sending)
            except (httpx.UnsupportedProtocol, httpx.LocalProtocolError):
                raise  # the request's own fault, not the key's: nor is it resent
            except httpx.TransportError as exc:
                key.contacted = True
                note_failure(self.set_aside, key, anyio.current_time(), sent_at)
                outcome: Outcome = "unsent" if isinstance(exc, _UNSENT) else "unknown"
                raise Again(None, None, outcome, key.key.name) from exc
            finally:
                for written in wrote:
                    key.sending.remove(written)
            wrote_at = wrote[0] if wrote else admitted_at
            key.contacted = True
            now = anyio.current_time()
            status = response.status_code
            wait = retry_after(response, now) if status in LIMITED else None
            if status == 429 or (status == 503 and wait is not None):
                answer = await closed(response, sending)
                key.limited += 1
                key.paused_until = max(key.paused_until, now + (wait or 0.0))
                adapt_down(self.adapt, runtime, key, now, wrote_at)
                raise Again(
                    ready_in(runtime, self._keys, tokens),
                    answer,
                    "refused",
                    key.key.name,
                    asked=wait,
                )
            if status >= 500:
                answer = await closed(response, sending)
                note_failure(self.set_aside, key, now, sent_at)
                raise Again(None, answer, "unknown", key.key.name)
            key.ok += 1
            note_recovered(key)
            note_accepted(key, tokens, now, wrote_at)
            # Grow back on answers too: with every request already queued, no new
            # attempt would come along to do it.
            adapt_up(self.adapt, runtime, key, now)
            if self.count_tokens is None or key.tokens_kind is None:
                response.stream = ReleasingStream(response.stream, context, key)
                handed_off = True
                return response
            await response.aread()
            actual = self.count_tokens(response)
        except BaseException as exc:
            if not handed_off:
                key.in_flight -= 1
                await context.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        key.in_flight -= 1
        await context.__aexit__(None, None, None)
        if actual is not None and actual > tokens:
            await self._pay(runtime, key.tokens_kind, float(actual) - tokens)
        return response

    async def _retake(
        self, runtime: Runtime, key: KeyState, tokens: float, deadline: Deadline | None
    ) -> None:
        """Take a late request's rate budget again (see ``_send_holding``).

        The budget taken at admission is not given back: that errs on the safe side, and
        it happens only to requests held up past a third of the jitter allowance.
        """
        need = {kind: amount for kind, amount in key.need(tokens).items() if kind in key.provider}
        if not need:
            return
        key.retaken += 1
        remaining = None if deadline is None else deadline.left()
        try:
            async with runtime.acquire(need, kind=f"{self.name}.late", wait_timeout=remaining):
                pass
        except TimeoutError as exc:
            raise QuotaDeadlineError(
                f"key {key.key.name!r} had no budget left within {deadline}"
            ) from exc
