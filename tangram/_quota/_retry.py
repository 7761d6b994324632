"""Retrying a request: only what is safe to send again, paced by the provider, logged.

**What is resent** is one rule, :func:`may_resend`. A request whose outcome is unknown (a
``5xx``, a reply that timed out, a connection lost mid-exchange) may have been done by the
server: a judge call billed, a job created. It is resent only if it is idempotent (RFC 9110
§9.2.2: ``GET``, ``HEAD``, ``OPTIONS``, ``TRACE``, ``PUT``, ``DELETE``; ``Retry(methods=)``
widens or narrows that), or its caller says so (``extensions={"tangram.idempotent": True}``,
or an ``Idempotency-Key`` header, which the server deduplicates by; ``Retry(idempotency_key=
True)`` adds one to each request that is not idempotent). A refusal (``429``, or ``503``
with ``Retry-After``, which say the request was not served) and a connection that failed
before anything was sent are resent whatever the method: the server has done nothing.

**The loop** is this module's, not :mod:`stamina`'s: stamina reports each
retry through process-wide hooks, and its default one logs at ``WARNING`` to the
``stamina`` logger, which Python prints bare to stderr in a worker that configured no
logging; turning the hooks off would turn them off for every other user of stamina in the
process. The waits were already ours (the provider's ``Retry-After``, growth on refusals),
so the loop is a few lines. Retries are logged to the ``tangram.quota`` logger instead:
refusals at ``DEBUG`` (routine pacing, possibly thousands), failures retried or not resent
at ``INFO``, each with its detail as record attributes (``method``, ``url`` without its
query, ``key``, ``status`` or ``error``, ``attempt``, ``attempts``, ``wait``).
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import logging
import random
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

import anyio
import attrs
import httpx

from .._core._validate import number, seconds, validator, whole
from ..errors import InvalidCapacityError, QuotaDeadlineError, SettingTypeError
from ._keys import SETTING_ERRORS

__all__ = [
    "IDEMPOTENCY_HEADER",
    "METHOD",
    "IDEMPOTENT_METHODS",
    "LIMITED",
    "Again",
    "Deadline",
    "Outcome",
    "Retry",
    "closed",
    "may_resend",
    "retry_after",
    "retrying",
]

#: Statuses by which a provider says "too many": the request is retried and the key's
#: rates cut (a ``503`` only when it says when to come back).
LIMITED = frozenset({429, 503})
#: Methods whose repeat has the effect of one request (RFC 9110 §9.2.2).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
#: The header by which a server deduplicates a resent request (IETF httpapi draft).
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: What a method may be written as (an RFC 9110 token): anything else fails in the
#: transport, which would count it against the key's health.
METHOD = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

#: How an attempt ended: ``"refused"`` (429 / 503 with ``Retry-After``: not served),
#: ``"unsent"`` (no connection: nothing reached the server), ``"unknown"`` (a ``5xx``, a
#: timeout or a connection lost after the request went out: it may have been served).
Outcome = Literal["refused", "unsent", "unknown"]

_log = logging.getLogger("tangram.quota")

_positive = validator(number, strict=True, finite=False, **SETTING_ERRORS)
_count = validator(whole, minimum=1, **SETTING_ERRORS)
_jitter = validator(seconds, **SETTING_ERRORS)


def _methods(value: Iterable[str]) -> frozenset[str]:
    """Upper-cased, as httpx writes a request's method; each a non-empty HTTP token."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise SettingTypeError(
            f"`methods` must be a set of HTTP method names like {{'GET', 'PUT'}} (got {value!r})"
        )
    methods = frozenset(value)
    for method in methods:
        message = f"`methods` must hold HTTP method names like 'GET' (got {method!r})"
        if not isinstance(method, str):
            raise SettingTypeError(message)
        if not METHOD.fullmatch(method):
            raise InvalidCapacityError(message)
    return frozenset(m.upper() for m in methods)


def _flag(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise SettingTypeError(f"`{attribute.name}` must be True or False (got {value!r})")


@attrs.frozen(kw_only=True)
class Retry:
    """How often, how long, and which requests to retry (jittered exponential backoff).

    ``Retry-After`` replaces the backoff when the provider sends it.

    :param attempts: sends at most, the first included.
    :param methods: methods resent after an outcome that is unknown (a ``5xx``, a
        timeout): the idempotent ones by default. Add ``"POST"`` for an API whose POSTs
        only read (a search), never for one that bills or creates per call.
    :param idempotency_key: add an ``Idempotency-Key`` header (a fresh UUID, the same on
        every resend) to each request whose method is not in ``methods`` and that has
        none, and resend those too: for providers that deduplicate by it.
    """

    attempts: int = attrs.field(default=8, validator=_count)
    wait_initial: float = attrs.field(default=0.05, validator=_positive)
    wait_max: float = attrs.field(default=5.0, validator=_positive)
    wait_jitter: float = attrs.field(default=0.05, validator=_jitter)
    methods: frozenset[str] = attrs.field(default=IDEMPOTENT_METHODS, converter=_methods)
    idempotency_key: bool = attrs.field(default=False, validator=_flag)


def may_resend(
    outcome: Outcome,
    method: str,
    *,
    marked: bool | None,
    methods: frozenset[str] = IDEMPOTENT_METHODS,
) -> bool:
    """Whether a request that ended in ``outcome`` may be sent again.

    ``marked`` is the caller's word (``True``: safe to repeat, ``False``: never repeat
    one that may have been served, ``None``: go by ``method``). A refused or unsent
    request is always safe: the server did nothing.
    """
    if outcome != "unknown":
        return True
    if marked is not None:
        return marked
    return method.upper() in methods


@attrs.frozen
class Deadline:
    """When a call must be answered by (loop time) and the limit it came from (seconds)."""

    at: float
    limit: float

    def left(self) -> float:
        return max(0.0, self.at - anyio.current_time())

    def __str__(self) -> str:
        return f"its deadline of {self.limit:g} s ({self.left():.3g} s left)"


class Again(Exception):
    """One attempt failed in a way worth retrying, if :func:`may_resend` allows."""

    def __init__(
        self,
        wait: float | None,
        response: httpx.Response | None,
        outcome: Outcome,
        key: str,
        *,
        asked: float | None = None,
    ) -> None:
        super().__init__("retry")
        #: seconds until some key could take a retry (refusals only).
        self.wait = wait
        self.response = response
        self.outcome = outcome
        self.key = key
        #: the provider's ``Retry-After``, when it sent one.
        self.asked = asked

    def reason(self) -> str:
        if self.response is not None:
            return f"HTTP {self.response.status_code}"
        return type(self.__cause__).__name__


def retry_after(response: httpx.Response, now: float) -> float | None:
    """Seconds the provider asked us to wait, if it said (``retry-after-ms`` first)."""
    millis = response.headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - _dt.datetime.now(_dt.timezone.utc)).total_seconds())


async def closed(response: httpx.Response, request: httpx.Request) -> httpx.Response:
    """The provider's answer, read whole and closed, for the caller if no resend is
    answered better: its status, headers and body as sent (the caller's client decodes
    the body by the headers). The provider's error text is what a caller debugs from: an
    empty body kept the headers' Content-Length of the one dropped.
    """
    headers = response.headers
    try:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    except httpx.HTTPError:  # the body was lost on the way: say there is none
        raw = b""
        headers = httpx.Headers(
            [
                (k, v)
                for k, v in headers.multi_items()
                if k not in ("content-length", "content-encoding")
            ]
        )
    finally:
        await response.aclose()
    stream = httpx.ByteStream(raw)
    return httpx.Response(response.status_code, headers=headers, stream=stream, request=request)


def _where(request: httpx.Request) -> str:
    """The request's URL without its query, which may carry a key or the user's text."""
    return str(request.url.copy_with(query=None, fragment=None))


def _wait(retry: Retry, again: Again, attempt: int, refusals: int) -> float:
    if again.wait is None:
        backoff = retry.wait_initial * 2.0 ** (attempt - 1) + random.uniform(0, retry.wait_jitter)
        return min(retry.wait_max, backoff)
    # Refused: wait what the provider asked, but at least the exponential backoff, so
    # that the attempts last longer than AIMD takes to find the real limit
    # (retry-after-ms alone is a few ms while the provider's bucket is empty, and used 8
    # attempts up in well under 1 s).
    grown = min(retry.wait_max, retry.wait_initial * 2.0 ** (refusals - 1))
    return max(again.wait, grown + random.uniform(0, retry.wait_jitter))


async def retrying(
    retry: Retry,
    request: httpx.Request,
    marked: bool | None,
    deadline: Deadline | None,
    attempt: Callable[[], Awaitable[httpx.Response]],
) -> httpx.Response:
    """``await attempt()`` until it returns, retrying each :class:`Again` it may resend.

    When the attempts are used up, or :func:`may_resend` says no, the caller gets the
    last answer (a ``5xx``, a ``429``) or the transport's error.

    :raises QuotaDeadlineError: waiting to retry would pass the request's deadline.
    """
    refusals = 0
    for tries in range(1, retry.attempts + 1):
        try:
            return await attempt()
        except Again as exc:
            again = exc
        refusals += again.outcome == "refused"
        detail = {
            "method": request.method,
            "url": _where(request),
            "key": again.key,
            "status": None if again.response is None else again.response.status_code,
            "error": None if again.response is not None else again.reason(),
            "attempt": tries,
            "attempts": retry.attempts,
        }
        if not may_resend(again.outcome, request.method, marked=marked, methods=retry.methods):
            _log.info(
                "not resending %s %s after %s: it may have been served, and it is not "
                "idempotent (mark it with extensions={'tangram.idempotent': True} or an "
                "Idempotency-Key header if a repeat is safe)",
                request.method,
                detail["url"],
                again.reason(),
                extra=detail,
            )
            break
        if tries == retry.attempts:
            break
        wait = _wait(retry, again, tries, refusals)
        if deadline is not None and wait > deadline.left():
            asked = ""
            if again.asked is not None:
                asked = f" (the provider's Retry-After: {again.asked:.3g} s)"
            raise QuotaDeadlineError(
                f"{request.method} {detail['url']}: retrying after {again.reason()} from key "
                f"{again.key!r} means waiting {wait:.3g} s{asked}, past {deadline}"
            ) from again.__cause__ or again
        _log.log(
            logging.DEBUG if again.outcome == "refused" else logging.INFO,
            "retrying %s %s in %.3g s after %s from key %r (attempt %d of %d)",
            request.method,
            detail["url"],
            wait,
            again.reason(),
            again.key,
            tries,
            retry.attempts,
            extra={**detail, "wait": wait},
        )
        await anyio.sleep(wait)
    if again.response is not None:
        return again.response
    cause = again.__cause__
    if isinstance(cause, Exception):
        raise cause from None
    raise again
