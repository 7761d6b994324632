"""A provider's keys: their configured limits, their state between requests, and which key
a request goes to.

Each key is up to three resource kinds of the runtime (``"<quota>.<key>.requests"``,
``".tokens"``, ``".concurrency"``). A request goes to the key whose budgets let it start
soonest; ties go to the key that has sent least, which keeps keys in balance. Keys that
are set aside, probing or not yet contacted are chosen only when nothing else is left.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypedDict

import anyio
import attrs
import httpx

from .._core._resources import Rate
from .._core._units import is_rate_text, parse_rate
from .._core._validate import real, whole
from .._runtime._run import Runtime
from ..errors import InvalidCapacityError, SettingTypeError

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_JITTER",
    "ApiKey",
    "KeyState",
    "SETTING_ERRORS",
    "KeyStats",
    "choose",
    "ready_in",
    "start_estimate",
]

#: Share of each configured rate the client uses by default: all of it. The burst margin
#: below (:data:`DEFAULT_JITTER`) is what keeps a client at the provider's own rate
#: unrefused: with a burst ``rate * d`` under the provider's, no span of arrivals delayed
#: by up to ``d`` holds more than the provider's bucket allows. (A 3% headroom here used to
#: give up that share of the limit for nothing: 97.0% against verl's limiter's 98.6%.)
DEFAULT_HEADROOM = 1.0
#: Seconds by which a request may reach the provider later than others admitted after it
#: (default for ``Quota(jitter=...)``). The client's bucket counts *admissions*, the
#: provider's counts *arrivals*: a request that spends ``d`` seconds more than the others
#: between the two (opening a connection, a busy event loop) lets ``rate * d`` requests
#: admitted after it arrive in the same window, past the provider's burst. Measured on
#: the loopback server (tests/test_quota.py): the first requests of a run wait 60-120 ms
#: for their connections while later ones arrive within 1-10 ms, which is what caused
#: stray 429s with a client burst only one unit below the provider's. The client's burst
#: is therefore the provider's less ``rate * jitter`` (at least one unit less, and at
#: least 2 where the provider's is: see ``KeyState.rates``), and a key's first request
#: goes alone, the others waiting for its answer, so connection set-up is out of the way.
DEFAULT_JITTER = 0.15


class _Errors(TypedDict):
    type_error: Callable[[str], Exception]
    value_error: Callable[[str], Exception]


#: What a bad quota setting raises, for the shared checks: the caller's error at the call,
#: in tangram's tree, a ``TypeError`` too for a value of the wrong type (``headroom="x"``).
SETTING_ERRORS: _Errors = {"type_error": SettingTypeError, "value_error": InvalidCapacityError}


def _requests(value: object) -> Rate | None:
    return _rate("requests", value)


def _tokens(value: object) -> Rate | None:
    return _rate("tokens", value)


def _rate(name: str, value: object) -> Rate | None:
    if value is None or isinstance(value, Rate):
        return value
    allowed = "a rate like '50/s', a number per second > 0 or tangram.Rate"
    if isinstance(value, str) and is_rate_text(value):
        try:
            per_second = parse_rate(value)
        except InvalidCapacityError as exc:
            raise InvalidCapacityError(f"`{name}`: {exc}") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        per_second = real(value)
    elif isinstance(value, str):
        raise InvalidCapacityError(f"`{name}` must be {allowed} (got {value!r})")
    else:
        raise SettingTypeError(f"`{name}` must be {allowed} (got {value!r})")
    if not (0 < per_second < math.inf):
        raise InvalidCapacityError(f"`{name}` must be {allowed}, and finite (got {value!r})")
    return Rate(per_second, burst=max(1.0, per_second))


def _concurrency(value: object) -> int | None:
    if value is None:
        return None
    return whole("concurrency", value, minimum=1, **SETTING_ERRORS)


def _headers(value: Mapping[str, str]) -> dict[str, str]:
    """A private copy: the caller's mapping may change after the key is made."""
    message = (
        f"`headers` must map header names to strings, like "
        f"{{'Authorization': 'Bearer ...'}} (got {value!r})"
    )
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SettingTypeError(message)
    if not all(value):
        raise InvalidCapacityError(message)
    return dict(value)


def _url(value: str | None) -> str | None:
    """Checked here: a bad base URL would otherwise fail at the first request it sends."""
    if value is None:
        return None
    allowed = "an http(s) base URL like 'https://api.example:8443'"
    if not isinstance(value, str):
        raise SettingTypeError(f"`url` must be {allowed} (got {value!r})")
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise InvalidCapacityError(f"`url` must be {allowed} (got {value!r})")
    return value


@attrs.frozen(kw_only=True)
class ApiKey:
    """One key (or endpoint) of a provider and the limits the provider gives it.

    :param name: a label, unique in its quota; it names the key's resource kinds.
    :param requests: requests per second (``"50/s"``, ``"3000/min"``, a number or
        :class:`tangram.Rate` for an explicit burst).
    :param tokens: tokens per second, charged per request (see :class:`Quota`).
    :param concurrency: requests in flight at once.
    :param headers: added to each request sent with this key (``Authorization`` ...).
    :param url: a base URL that replaces scheme, host and port: a key per endpoint.
    :raises InvalidCapacityError: a limit, header or URL that no request could be sent with.
    :raises SettingTypeError: an argument of the wrong type (``requests=[50]``).
    """

    name: str = attrs.field()
    requests: Rate | None = attrs.field(default=None, converter=_requests)
    tokens: Rate | None = attrs.field(default=None, converter=_tokens)
    concurrency: int | None = attrs.field(default=None, converter=_concurrency)
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=_headers)
    url: str | None = attrs.field(default=None, converter=_url)

    @name.validator
    def _check_name(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not isinstance(value, str):
            raise SettingTypeError(f"`name` must be a non-empty string (got {value!r})")
        if not value:
            raise InvalidCapacityError(f"`name` must be a non-empty string (got {value!r})")

    def __attrs_post_init__(self) -> None:
        if self.requests is None and self.tokens is None and self.concurrency is None:
            raise InvalidCapacityError(
                f"key {self.name!r} needs at least one of `requests`, `tokens`, `concurrency`"
            )


@attrs.frozen
class KeyStats:
    """What one key did: requests sent, answered, limited (429/503) and failed."""

    sent: int
    ok: int
    limited: int
    failed: int
    in_flight: int
    set_aside: bool
    #: effective rate now as a share of the configured one (AIMD's state; above 1 only
    #: when ``Adapt(above=...)`` lets it probe past the configured rate).
    rate_share: float


class KeyState:
    """Mutable per-key state: the scheduler's view of one key between requests.

    One object for every concern of a key (its budgets, AIMD's memory, setting it aside,
    its first contact), because each reads the others' fields: choosing a key reads the
    pause and the set-aside, AIMD reads the counts of what was sent and accepted.
    """

    def __init__(self, quota_name: str, key: ApiKey, headroom: float, jitter: float) -> None:
        self.key = key
        prefix = f"{quota_name}.{key.name}"
        self.requests_kind = f"{prefix}.requests" if key.requests is not None else None
        self.tokens_kind = f"{prefix}.tokens" if key.tokens is not None else None
        self.slots_kind = f"{prefix}.concurrency" if key.concurrency is not None else None
        self.headroom = headroom
        self.jitter = jitter
        #: the provider's rates as configured, and the share of them used at most.
        self.provider: dict[str, Rate] = {}
        self.configured: dict[str, Rate] = {}
        for kind, rate in ((self.requests_kind, key.requests), (self.tokens_kind, key.tokens)):
            if kind is not None and rate is not None:
                self.provider[kind] = rate
                self.configured[kind] = Rate(rate.per_second * headroom, burst=rate.burst)
        #: the largest amount one request asked of each rate: no burst goes below it.
        self.largest: dict[str, float] = {}
        self.share = 1.0
        self.cut_at = -math.inf
        self.adapted_at = -math.inf
        self.paused_until = -math.inf
        self.aside_until = -math.inf
        self.aside_at = -math.inf
        self.asides = 0
        self.probing = False
        # A key's first request goes alone and the rest wait for its answer: it opens the
        # first connection (name lookup, the executor's threads, TCP set-up), which takes
        # 60-120 ms on a busy machine against 1-10 ms for later requests, and the budget
        # that refills meanwhile would otherwise arrive at the provider all at once.
        self.contacted = False
        self.contact: anyio.Event | None = None
        # AIMD's memory: the provider's limit as last measured, as a share of the
        # configured rate (math.inf: never refused), and since when the rate has held
        # at its plateau just under it.
        self.refused = math.inf
        self.plateau_since = math.inf
        # When the provider began refusing requests sent at the rate in effect (math.inf:
        # it is not), when that first refused request was sent, and when it last refused
        # one: AIMD measures the limit meanwhile.
        self.overload_at = math.inf
        self.overload_sent = math.inf
        # Refusals since then: dense ones show a rate above the limit, sparse ones bunching.
        self.overload_refusals = 0
        self.refused_at = -math.inf
        self.failures = 0
        self.waiting: dict[str, float] = dict.fromkeys(self.configured, 0.0)
        self.waiting_count = 0
        self.in_flight = 0
        self.sent = self.ok = self.limited = self.failed = 0
        self.retaken = 0
        # (answer time, send time, tokens) of the requests the provider accepted lately,
        # oldest first: those since the refusals began are AIMD's measure of the limit.
        self.answered: collections.deque[tuple[float, float, float]] = collections.deque()
        # When the requests now in flight had their headers written: all accepted ones
        # sent before the earliest have been answered, so the measure may count to it.
        self.sending: list[float] = []

    def rates(self) -> dict[str, Rate]:
        """The effective rates: the provider's scaled by headroom and AIMD's share.

        Bursts: a provider's burst is believed to scale with its rate (AIMD cuts both),
        less the jitter margin (see :data:`DEFAULT_JITTER`); but at least 2 units where
        the provider allows 2, because with a burst of 1 every millisecond the timer
        fires late is budget lost for good (measured: 86% of the limit instead of 97%
        at 50 requests/s on a busy loop), and never below the largest request seen. A
        rate probed above the configured one (``Adapt(above=...)``) keeps the configured
        burst: nothing measured a larger one.
        """
        rates: dict[str, Rate] = {}
        for kind, rate in self.provider.items():
            per_second = rate.per_second * self.headroom * self.share
            believed = rate.burst * min(1.0, self.share)
            margin = max(1.0, per_second * self.jitter)
            burst = max(min(2.0, believed), min(believed * self.headroom, believed - margin))
            rates[kind] = Rate(per_second, burst=max(1.0, burst, self.largest.get(kind, 0.0)))
        return rates

    def need(self, tokens: float) -> dict[str, float]:
        need: dict[str, float] = {}
        if self.requests_kind is not None:
            need[self.requests_kind] = 1.0
        if self.tokens_kind is not None and tokens > 0:
            need[self.tokens_kind] = tokens
            if tokens > self.largest.get(self.tokens_kind, 0.0):
                self.largest[self.tokens_kind] = tokens
        if self.slots_kind is not None:
            need[self.slots_kind] = 1.0
        return need

    def stats(self, now: float) -> KeyStats:
        return KeyStats(
            self.sent,
            self.ok,
            self.limited,
            self.failed,
            self.in_flight,
            self.aside_until > now,
            self.share,
        )


def _level(runtime: Runtime, kind: str, now: float) -> float:
    """A rate budget's level now (the ledger refills lazily, at each scheduling step)."""
    return runtime._ledger.level(kind, now)


def start_estimate(runtime: Runtime, key: KeyState, need: Mapping[str, float]) -> float:
    """Seconds until ``key``'s budgets could admit ``need`` behind what already waits."""
    now = anyio.current_time()
    start = max(0.0, key.paused_until - now)
    if key.aside_until > now:
        start = max(start, key.aside_until - now)
    rates = runtime._ledger.rates
    for kind in key.configured:
        amount = need.get(kind, 0.0) + key.waiting[kind]
        if amount > 0 and kind in rates:
            deficit = amount - _level(runtime, kind, now)
            start = max(start, deficit / rates[kind])
    return start


def choose(runtime: Runtime, keys: Sequence[KeyState], tokens: float) -> tuple[KeyState, float]:
    """The key a request of ``tokens`` goes to, and seconds until it could start there."""
    now = anyio.current_time()
    best: tuple[float, float, int] | None = None
    chosen = keys[0]
    for key in keys:
        # Set aside, its one probe still out, or its first request not yet answered:
        # only if nothing else is left.
        busy = key.aside_until > now or key.probing or key.contact is not None
        penalty = 1e9 if busy else 0.0
        start = start_estimate(runtime, key, key.need(tokens))
        load = (key.in_flight + key.waiting_count) / (key.key.concurrency or 1_000_000)
        rank = (penalty + round(start, 3), load, key.sent)
        if best is None or rank < best:
            best, chosen = rank, key
    assert best is not None
    start = start_estimate(runtime, chosen, chosen.need(tokens))
    return chosen, start


def ready_in(runtime: Runtime, keys: Sequence[KeyState], tokens: float) -> float:
    """Seconds until some key could take a retry: the backoff after a 429."""
    return min(start_estimate(runtime, k, k.need(tokens)) for k in keys)
