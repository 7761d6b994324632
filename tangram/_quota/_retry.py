"""Retrying a request through :mod:`stamina`, paced by the provider's ``Retry-After``.

An attempt that is worth retrying raises :class:`Again` with the wait it suggests (the
provider's, or the time until some key could take it); :func:`retrying` runs attempts
until one returns, the attempts are used up (the caller then sees the last answer) or
the request's deadline would pass first (:class:`~tangram.errors.QuotaDeadlineError`).
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import random
from collections.abc import Awaitable, Callable

import anyio
import attrs
import httpx
import stamina

from .._core._validate import number, seconds, validator, whole
from ..errors import QuotaDeadlineError

__all__ = ["LIMITED", "Again", "Retry", "closed", "retry_after", "retrying"]

#: Statuses by which a provider says "too many": the request is retried and the key's
#: rates cut (a ``503`` only when it says when to come back).
LIMITED = frozenset({429, 503})

_positive = validator(number, strict=True, finite=False, type_error=ValueError)
_count = validator(whole, minimum=1, type_error=ValueError)


@attrs.frozen(kw_only=True)
class Retry:
    """How often and how long to retry through :mod:`stamina` (jittered exponential backoff).

    ``Retry-After`` replaces the backoff when the provider sends it.
    """

    attempts: int = attrs.field(default=8, validator=_count)
    wait_initial: float = attrs.field(default=0.05, validator=_positive)
    wait_max: float = attrs.field(default=5.0, validator=_positive)
    wait_jitter: float = attrs.field(default=0.05, validator=validator(seconds))


class Again(Exception):
    """One attempt failed in a way worth retrying; carries the wait stamina should use."""

    def __init__(self, wait: float | None, response: httpx.Response | None) -> None:
        super().__init__("retry")
        self.wait = wait
        self.response = response


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


def closed(response: httpx.Response, request: httpx.Request) -> httpx.Response:
    """A closed response the caller may still read status and headers from."""
    return httpx.Response(
        response.status_code, headers=response.headers, content=b"", request=request
    )


async def retrying(
    retry: Retry, deadline: float | None, attempt: Callable[[], Awaitable[httpx.Response]]
) -> httpx.Response:
    """``await attempt()`` until it returns, retrying each :class:`Again` it raises.

    :raises QuotaDeadlineError: the provider kept refusing until the deadline.
    """
    stopped_by_deadline = False
    limited = 0

    def backoff(exc: Exception) -> bool | float:
        nonlocal stopped_by_deadline, limited
        if not isinstance(exc, Again):
            return False
        wait = exc.wait
        if wait is not None:
            # Refused (429/503): wait what the provider asked, but at least stamina's
            # own exponential backoff, so that the attempts last longer than AIMD takes
            # to find the real limit (retry-after-ms alone is a few ms while the
            # provider's bucket is empty, and used 8 attempts up in well under 1 s).
            limited += 1
            grown = min(retry.wait_max, retry.wait_initial * 2 ** (limited - 1))
            wait = max(wait, grown + random.uniform(0, retry.wait_jitter))
        if deadline is not None:
            ahead = wait if wait is not None else retry.wait_initial
            if anyio.current_time() + ahead > deadline:
                stopped_by_deadline = True
                return False
        return True if wait is None else wait

    try:
        async for attempt_context in stamina.retry_context(
            on=backoff,
            attempts=retry.attempts,
            timeout=None,
            wait_initial=retry.wait_initial,
            wait_max=retry.wait_max,
            wait_jitter=retry.wait_jitter,
        ):
            with attempt_context:
                return await attempt()
    except Again as exc:
        if stopped_by_deadline:
            raise QuotaDeadlineError(
                "the provider kept refusing this request until its deadline"
            ) from exc.__cause__ or exc
        if exc.response is not None:
            return exc.response  # attempts used up: the caller sees the last answer
        cause = exc.__cause__
        if isinstance(cause, Exception):
            raise cause from None
        raise
    raise AssertionError("unreachable: stamina yields until success or raises")
