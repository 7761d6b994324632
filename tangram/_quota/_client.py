"""API quotas: rate and concurrency limits per key, keys pooled, behind a plain httpx client.

A provider's quota is two resource kinds the core already schedules: a *rate* (requests or
tokens per second, a token bucket with a burst) taken at admission and never given back,
and a *count* (concurrent requests) held while the request is in flight. Each key of a
:class:`Quota` becomes up to three kinds in the runtime (``"<quota>.<key>.requests"``,
``".tokens"``, ``".concurrency"``), so quota admissions share one queue, one policy and one
set of stats with every other action of the rollout.

What this layer adds on top of the core:

- **Keys as one pool.** Each request goes to the key whose budgets let it start soonest
  (ties go to the key that has sent least, which keeps keys in balance).
- **Token estimates, corrected.** A request takes its *estimated* tokens at admission.
  When ``count_tokens`` reads the real count from the response and it is larger, the
  difference is taken from the same budget before the response is handed back (the caller
  that overspent waits, nobody else does), so the long-run token rate is exact. A smaller
  real count is *not* credited back: the core's token buckets only ever give units out,
  and an over-estimate costs throughput, never a ``429``.
- **429 and 503.** ``Retry-After`` (or the more precise ``retry-after-ms``) pauses the key
  for that long; the request is retried through :mod:`stamina` (on another key when one is
  ready) and the key's rates are cut multiplicatively and grown back additively (AIMD)
  with :meth:`tangram.Runtime.set_capacity`, so a configured limit above the provider's
  real one converges below it.
- **Keys that keep failing** (transport errors, ``5xx``) are set aside for a cool-down
  that doubles on each repeat, then given one probe request.
- **Deadlines fail fast.** A request whose key cannot start it before its deadline raises
  :class:`QuotaDeadlineError` at once instead of waiting to time out.

Cancellation at any point returns the request's slot: slots are leases of the core and
every path out of a request exits them.
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs
import httpx
import stamina

from .._core._resources import Rate
from .._core._units import is_rate_text, parse_rate
from .._runtime._run import AcquireContext, Runtime, current_runtime
from ..errors import InvalidCapacityError, QuotaDeadlineError

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_JITTER",
    "Adapt",
    "ApiKey",
    "KeyStats",
    "Quota",
    "QuotaDeadlineError",
    "QuotaTransport",
    "Retry",
    "SetAside",
]

#: Share of each configured rate the client uses by default. Loopback and provider clocks
#: differ and requests reorder on the wire; 3% headroom lets the provider's bucket stay
#: full in steady state so that jitter never trips it.
DEFAULT_HEADROOM = 0.97
#: Seconds by which a request may reach the provider later than others admitted after it
#: (default for ``Quota(jitter=...)``). The client's bucket counts *admissions*, the
#: provider's counts *arrivals*: a request that spends ``d`` seconds more than the others
#: between the two (opening a connection, a busy event loop) lets ``rate * d`` requests
#: admitted after it arrive in the same window, past the provider's burst. Measured on
#: the loopback server (tests/test_quota.py): the first requests of a run wait 60-120 ms
#: for their connections while later ones arrive within 1-10 ms, which is what caused
#: stray 429s with a client burst only one unit below the provider's. The client's burst
#: is therefore the provider's less ``rate * jitter`` (at least one unit less, and at
#: least 2 where the provider's is: see ``_Key.rates``), and a key's first request goes
#: alone, the others waiting for its answer, so connection set-up is out of the way.
DEFAULT_JITTER = 0.15
#: Request extension keys a caller may set per request (``extensions={...}`` in httpx).
TOKENS_EXTENSION = "tangram.tokens"
DEADLINE_EXTENSION = "tangram.deadline"
_LIMITED = frozenset({429, 503})
_ADAPT_EVERY = 0.1


def _requests(value: object) -> Rate | None:
    return _rate("requests", value)


def _tokens(value: object) -> Rate | None:
    return _rate("tokens", value)


def _rate(name: str, value: object) -> Rate | None:
    if value is None or isinstance(value, Rate):
        return value
    if isinstance(value, str) and is_rate_text(value):
        per_second = parse_rate(value)
        return Rate(per_second, burst=max(1.0, per_second))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Rate(value, burst=max(1.0, float(value)))
    raise InvalidCapacityError(
        f"`{name}` must be a rate like '50/s', a number per second or tangram.Rate (got {value!r})"
    )


def _concurrency(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidCapacityError(f"`concurrency` must be a whole number >= 1 (got {value!r})")
    return value


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`{attribute.name}` must be a number > 0 (got {value!r})")


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"`{attribute.name}` must be in (0, 1] (got {value!r})")


def _headers(value: Mapping[str, str]) -> dict[str, str]:
    """A private copy: the caller's mapping may change after the key is made."""
    return dict(value)


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
    """

    name: str = attrs.field()
    requests: Rate | None = attrs.field(default=None, converter=_requests)
    tokens: Rate | None = attrs.field(default=None, converter=_tokens)
    concurrency: int | None = attrs.field(default=None, converter=_concurrency)
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=_headers)
    url: str | None = None

    @name.validator
    def _check_name(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not isinstance(value, str) or not value:
            raise ValueError(f"`name` must be a non-empty string (got {value!r})")

    def __attrs_post_init__(self) -> None:
        if self.requests is None and self.tokens is None and self.concurrency is None:
            raise InvalidCapacityError(
                f"key {self.name!r} needs at least one of `requests`, `tokens`, `concurrency`"
            )


@attrs.frozen(kw_only=True)
class Adapt:
    """AIMD on a key's rates when the provider's real limit is below the configured one.

    On a ``429`` or ``503`` the key's rates drop to ``decrease`` times the *refused* rate:
    the rate in effect, or what the provider actually accepted of the requests sent since
    the last cut (over at least ``window`` seconds of sending) when that is lower, so a
    limit far below the configured one is found in one step, not many; at most once per
    ``cooldown``. Afterwards they grow back by
    ``increase`` of the rate at the last cut per second up to ``plateau`` times the refused
    rate, stay there, and only after ``hold`` seconds without a ``429`` keep growing
    towards the configured rate (the provider may have raised its limit). Never below
    ``floor`` of the configured rate.
    """

    decrease: float = attrs.field(default=0.85, validator=_fraction)
    increase: float = attrs.field(default=0.04, validator=_positive)
    cooldown: float = attrs.field(default=1.0, validator=_positive)
    window: float = attrs.field(default=0.5, validator=_positive)
    floor: float = attrs.field(default=0.02, validator=_fraction)
    plateau: float = attrs.field(default=0.97, validator=_fraction)
    hold: float = attrs.field(default=30.0, validator=_positive)


@attrs.frozen(kw_only=True)
class Retry:
    """How often and how long to retry through :mod:`stamina` (jittered exponential backoff).

    ``Retry-After`` replaces the backoff when the provider sends it.
    """

    attempts: int = attrs.field(default=8)
    wait_initial: float = attrs.field(default=0.05, validator=_positive)
    wait_max: float = attrs.field(default=5.0, validator=_positive)
    wait_jitter: float = attrs.field(default=0.05, validator=attrs.validators.ge(0))

    @attempts.validator
    def _check_attempts(self, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`attempts` must be a whole number >= 1 (got {value!r})")


@attrs.frozen(kw_only=True)
class SetAside:
    """When a failing key is set aside: after ``failures`` in a row (transport errors or
    ``5xx`` other than a ``503`` that says when to come back), for ``cooldown`` seconds,
    doubling on each repeat up to ``max_cooldown``; then one probe decides."""

    failures: int = attrs.field(default=3)
    cooldown: float = attrs.field(default=2.0, validator=_positive)
    max_cooldown: float = attrs.field(default=60.0, validator=_positive)

    @failures.validator
    def _check_failures(self, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`failures` must be a whole number >= 1 (got {value!r})")


@attrs.frozen
class KeyStats:
    """What one key did: requests sent, answered, limited (429/503) and failed."""

    sent: int
    ok: int
    limited: int
    failed: int
    in_flight: int
    set_aside: bool
    #: effective rate now as a share of the configured one (AIMD's state).
    rate_share: float


class _Key:
    """Mutable per-key state: the scheduler's view of one key between requests."""

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
        self.ceiling = 1.0
        self.cut_at = -math.inf
        self.adapted_at = -math.inf
        self.first_sent = math.inf
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
        # AIMD's memory: the share at which the provider last refused (or the share it
        # was seen to accept then, when lower) and when the rate last reached below it.
        self.refused = math.inf
        self.plateau_since = math.inf
        self.failures = 0
        self.waiting: dict[str, float] = dict.fromkeys(self.configured, 0.0)
        self.waiting_count = 0
        self.in_flight = 0
        self.sent = self.ok = self.limited = self.failed = 0
        self.retaken = 0
        # Requests (and their tokens) sent since the last cut that the provider accepted,
        # and when the last of them was sent: AIMD's measure of the real limit.
        self.accepted = 0
        self.accepted_tokens = 0.0
        self.accepted_until = -math.inf

    def rates(self) -> dict[str, Rate]:
        """The effective rates: the provider's scaled by headroom and AIMD's share.

        Bursts: a provider's burst is believed to scale with its rate (AIMD cuts both),
        less the jitter margin (see :data:`DEFAULT_JITTER`); but at least 2 units where
        the provider allows 2, because with a burst of 1 every millisecond the timer
        fires late is budget lost for good (measured: 86% of the limit instead of 97%
        at 50 requests/s on a busy loop), and never below the largest request seen.
        """
        rates: dict[str, Rate] = {}
        for kind, rate in self.provider.items():
            per_second = rate.per_second * self.headroom * self.share
            believed = rate.burst * self.share
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


def _level(runtime: Runtime, kind: str, now: float) -> float:
    """A rate budget's level now (the ledger refills lazily, at each scheduling step)."""
    return runtime._ledger.level(kind, now)


def _retry_after(response: httpx.Response, now: float) -> float | None:
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


class _Again(Exception):
    """One attempt failed in a way worth retrying; carries the wait stamina should use."""

    def __init__(self, wait: float | None, response: httpx.Response | None) -> None:
        super().__init__("retry")
        self.wait = wait
        self.response = response


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
    :param deadline: default seconds a request may wait to be sent; a request's
        ``extensions={"tangram.deadline": s}`` overrides it.
    :param adapt: AIMD settings, or ``None`` to trust the configured rates.
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
        deadline: float | None = None,
        retry: Retry | None = None,
        adapt: Adapt | None = Adapt(),
        set_aside: SetAside | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        keys = list(keys)
        if not keys or not all(isinstance(k, ApiKey) for k in keys):
            raise TypeError(f"`keys` must be a non-empty sequence of ApiKey (got {keys!r})")
        if len({k.name for k in keys}) != len(keys):
            raise ValueError("key names must be unique within a quota")
        if not isinstance(name, str) or not name:
            raise ValueError(f"`name` must be a non-empty string (got {name!r})")
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)):
            raise TypeError(f"`headroom` must be a number (got {headroom!r})")
        if not 0 < headroom <= 1:
            raise ValueError(f"`headroom` must be in (0, 1] (got {headroom!r})")
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)):
            raise TypeError(f"`jitter` must be a number of seconds (got {jitter!r})")
        if not 0 <= jitter < math.inf:
            raise ValueError(f"`jitter` must be >= 0 seconds and finite (got {jitter!r})")
        if deadline is not None and (isinstance(deadline, bool) or not deadline >= 0):
            raise ValueError(f"`deadline` must be >= 0 seconds or None (got {deadline!r})")
        self.name = name
        self.estimate_tokens = estimate_tokens
        self.count_tokens = count_tokens
        self.deadline = deadline
        self.retry = retry if retry is not None else Retry()
        self.adapt = adapt
        self.set_aside = set_aside if set_aside is not None else SetAside()
        self._runtime = runtime
        self.jitter = float(jitter)
        self._keys = [_Key(name, key, float(headroom), float(jitter)) for key in keys]

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
        return {
            k.key.name: KeyStats(
                k.sent, k.ok, k.limited, k.failed, k.in_flight, k.aside_until > now, k.share
            )
            for k in self._keys
        }

    # -- scheduling --------------------------------------------------------------------

    def _attach(self) -> Runtime:
        runtime = self._runtime if self._runtime is not None else current_runtime()
        capacity = runtime.capacity
        missing = {kind: v for kind, v in self.capacity().items() if kind not in capacity}
        if missing:
            runtime.set_capacity(missing)
        return runtime

    def _start_estimate(self, runtime: Runtime, key: _Key, need: Mapping[str, float]) -> float:
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

    def _choose(self, runtime: Runtime, tokens: float) -> tuple[_Key, float]:
        now = anyio.current_time()
        best: tuple[float, float, int] | None = None
        chosen = self._keys[0]
        for key in self._keys:
            # Set aside, its one probe still out, or its first request not yet answered:
            # only if nothing else is left.
            busy = key.aside_until > now or key.probing or key.contact is not None
            penalty = 1e9 if busy else 0.0
            start = self._start_estimate(runtime, key, key.need(tokens))
            load = (key.in_flight + key.waiting_count) / (key.key.concurrency or 1_000_000)
            rank = (penalty + round(start, 3), load, key.sent)
            if best is None or rank < best:
                best, chosen = rank, key
        assert best is not None
        start = self._start_estimate(runtime, chosen, chosen.need(tokens))
        return chosen, start

    def _adapt_up(self, runtime: Runtime, key: _Key, now: float) -> None:
        adapt = self.adapt
        if adapt is None or key.share >= 1.0 or now - key.adapted_at < _ADAPT_EVERY:
            return
        since = now - max(key.adapted_at, key.cut_at)
        key.adapted_at = now
        plateau = min(1.0, key.refused * adapt.plateau)
        if key.share >= plateau:
            # Hold just under the rate the provider refused; probe above it only after
            # `hold` quiet seconds (its limit may have been raised), else the probing
            # itself would bring a 429 every few seconds for ever.
            if key.plateau_since == math.inf:
                key.plateau_since = now
            if now - key.plateau_since < adapt.hold:
                return
            plateau = 1.0
        share = min(plateau, key.share + adapt.increase * key.ceiling * since)
        if share != key.share:
            key.share = share
            runtime.set_capacity(key.rates())

    def _adapt_down(self, runtime: Runtime, key: _Key, now: float) -> None:
        adapt = self.adapt
        if adapt is None or now - key.cut_at < adapt.cooldown:
            return
        refused = key.share
        # What the provider took since the last cut measures its real limit when we were
        # sending past it all along (a 429 now says we were): jump there instead of
        # cutting many times. Counted from the last cut, not over a sliding window: the
        # first cut comes at the first 429, when the provider's burst is spent, so the
        # count after it has no burst in it (a 1 s window overestimated by the burst, and
        # the plateau above the limit then drew a 429 every few seconds).
        # Counted by send time: requests in flight at the cut were admitted at the old
        # rate, and those sent just now have not been answered yet.
        span = key.accepted_until - max(key.cut_at, key.first_sent)
        # Under `window` the count says more about start-up bunching than the limit.
        if key.accepted and span >= adapt.window:
            ratios: list[float] = []
            # Less what the provider's bucket may have held at the cut: under one request
            # (it had just refused one), else short spans overestimate by 1 / span.
            if key.requests_kind is not None:
                done = max(0.0, key.accepted - 1.0) / span
                ratios.append(done / key.configured[key.requests_kind].per_second)
            if key.tokens_kind is not None:
                spare = key.largest.get(key.tokens_kind, 0.0)
                used = max(0.0, key.accepted_tokens - spare) / span
                ratios.append(used / key.configured[key.tokens_kind].per_second)
            if ratios:
                refused = min(refused, max(ratios))
        key.accepted = 0
        key.accepted_tokens = 0.0
        key.accepted_until = -math.inf
        key.refused = refused
        key.plateau_since = math.inf
        share = max(adapt.floor, min(key.share, refused) * adapt.decrease)
        key.share = key.ceiling = share
        key.cut_at = key.adapted_at = now
        runtime.set_capacity(key.rates())

    def _note_failure(self, key: _Key, now: float, sent_at: float) -> None:
        key.failed += 1
        if sent_at < key.aside_at:
            # Sent before the key was set aside: its failure says nothing new, and letting
            # it double the cool-down would push the probe out by every request in flight.
            return
        key.failures += 1
        if key.aside_until > -math.inf or key.failures >= self.set_aside.failures:
            cooldown = min(self.set_aside.max_cooldown, self.set_aside.cooldown * 2**key.asides)
            key.asides += 1
            key.aside_at = now
            key.aside_until = now + cooldown
            key.failures = 0

    def _note_success(self, key: _Key, now: float, sent_at: float, tokens: float) -> None:
        key.ok += 1
        key.failures = 0
        if key.aside_until > -math.inf:
            key.asides = 0
            key.aside_until = -math.inf
        if sent_at >= key.cut_at:
            key.accepted += 1
            key.accepted_tokens += tokens
            key.accepted_until = max(key.accepted_until, sent_at)

    def _deadline_of(self, request: httpx.Request) -> float | None:
        value = request.extensions.get(DEADLINE_EXTENSION, self.deadline)
        if value is None:
            return None
        return anyio.current_time() + float(value)

    def _tokens_of(self, request: httpx.Request) -> float:
        value = request.extensions.get(TOKENS_EXTENSION)
        if value is None and self.estimate_tokens is not None:
            value = self.estimate_tokens(request)
        return float(value or 0.0)

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

        :raises QuotaDeadlineError: it could not be sent before its deadline.
        """
        runtime = self._attach()
        tokens = self._tokens_of(request)
        deadline = self._deadline_of(request)
        await request.aread()  # a retry resends the body
        stopped_by_deadline = False
        limited = 0

        def backoff(exc: Exception) -> bool | float:
            nonlocal stopped_by_deadline, limited
            if not isinstance(exc, _Again):
                return False
            wait = exc.wait
            if wait is not None:
                # Refused (429/503): wait what the provider asked, but at least stamina's
                # own exponential backoff, so that the attempts last longer than AIMD takes
                # to find the real limit (retry-after-ms alone is a few ms while the
                # provider's bucket is empty, and used 8 attempts up in well under 1 s).
                limited += 1
                retry = self.retry
                grown = min(retry.wait_max, retry.wait_initial * 2 ** (limited - 1))
                wait = max(wait, grown + random.uniform(0, retry.wait_jitter))
            if deadline is not None:
                ahead = wait if wait is not None else self.retry.wait_initial
                if anyio.current_time() + ahead > deadline:
                    stopped_by_deadline = True
                    return False
            return True if wait is None else wait

        try:
            async for attempt in stamina.retry_context(
                on=backoff,
                attempts=self.retry.attempts,
                timeout=None,
                wait_initial=self.retry.wait_initial,
                wait_max=self.retry.wait_max,
                wait_jitter=self.retry.wait_jitter,
            ):
                with attempt:
                    return await self._attempt(runtime, request, transport, tokens, deadline)
        except _Again as exc:
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

    async def _attempt(
        self,
        runtime: Runtime,
        request: httpx.Request,
        transport: httpx.AsyncBaseTransport,
        tokens: float,
        deadline: float | None,
    ) -> httpx.Response:
        while True:
            key, start = self._choose(runtime, tokens)
            now = anyio.current_time()
            remaining = None if deadline is None else deadline - now
            if remaining is not None and start > remaining:
                raise QuotaDeadlineError(
                    f"key {key.key.name!r} can start this request in {start:.3g} s, "
                    f"past its deadline in {max(0.0, remaining):.3g} s"
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
                self._adapt_up(runtime, key, now)
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
                        f"no slot on key {key.key.name!r} before the deadline"
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

    async def _await_contact(self, key: _Key, deadline: float | None) -> None:
        """Wait for the answer to a key's first request (see ``_Key.contacted``)."""
        event = key.contact
        assert event is not None
        if deadline is None:
            await event.wait()
            return
        with anyio.move_on_after(deadline - anyio.current_time()):
            await event.wait()
        if not event.is_set():
            raise QuotaDeadlineError(
                f"key {key.key.name!r} had not answered its first request before the deadline"
            )

    async def _send_holding(
        self,
        runtime: Runtime,
        context: AcquireContext,
        key: _Key,
        request: httpx.Request,
        transport: httpx.AsyncBaseTransport,
        tokens: float,
        deadline: float | None,
    ) -> httpx.Response:
        """Send with the slot held; hand the slot to the response stream on success."""
        key.in_flight += 1
        handed_off = False
        admitted_at = anyio.current_time()
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
            if name.endswith(".send_request_headers.started") and late > self.jitter / 3:
                await self._retake(runtime, key, tokens, deadline)
            if user_trace is not None:
                await user_trace(name, info)

        try:
            outgoing = self._outgoing(request, key, trace)
            key.sent += 1
            sent_at = anyio.current_time()
            key.first_sent = min(key.first_sent, sent_at)
            try:
                response = await transport.handle_async_request(outgoing)
            except httpx.TransportError as exc:
                key.contacted = True
                self._note_failure(key, anyio.current_time(), sent_at)
                raise _Again(None, None) from exc
            key.contacted = True
            now = anyio.current_time()
            status = response.status_code
            wait = _retry_after(response, now) if status in _LIMITED else None
            if status == 429 or (status == 503 and wait is not None):
                await response.aclose()
                key.limited += 1
                key.paused_until = max(key.paused_until, now + (wait or 0.0))
                self._adapt_down(runtime, key, now)
                raise _Again(self._ready_in(runtime, tokens), _closed(response, outgoing))
            if status >= 500:
                await response.aclose()
                self._note_failure(key, now, sent_at)
                raise _Again(None, _closed(response, outgoing))
            self._note_success(key, now, sent_at, tokens)
            # Grow back on answers too: with every request already queued, no new
            # attempt would come along to do it.
            self._adapt_up(runtime, key, now)
            if self.count_tokens is None or key.tokens_kind is None:
                response.stream = _ReleasingStream(response.stream, context, key)
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

    def _ready_in(self, runtime: Runtime, tokens: float) -> float:
        """Seconds until some key could take a retry: the backoff after a 429."""
        return min(self._start_estimate(runtime, k, k.need(tokens)) for k in self._keys)

    async def _retake(
        self, runtime: Runtime, key: _Key, tokens: float, deadline: float | None
    ) -> None:
        """Take a late request's rate budget again (see ``_send_holding``).

        The budget taken at admission is not given back: that errs on the safe side, and
        it happens only to requests held up past a third of the jitter allowance.
        """
        need = {kind: amount for kind, amount in key.need(tokens).items() if kind in key.provider}
        if not need:
            return
        key.retaken += 1
        remaining = None if deadline is None else max(0.0, deadline - anyio.current_time())
        try:
            async with runtime.acquire(need, kind=f"{self.name}.late", wait_timeout=remaining):
                pass
        except TimeoutError as exc:
            raise QuotaDeadlineError(
                f"key {key.key.name!r} had no budget left before the deadline"
            ) from exc

    def _outgoing(
        self,
        request: httpx.Request,
        key: _Key,
        trace: Callable[[str, dict[str, Any]], Awaitable[None]],
    ) -> httpx.Request:
        url = request.url
        if key.key.url is not None:
            base = httpx.URL(key.key.url)
            url = url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
        headers = request.headers.copy()
        headers.update(key.key.headers)
        return httpx.Request(
            request.method,
            url,
            headers=headers,
            content=request.content,
            extensions={**request.extensions, "trace": trace},
        )


def _closed(response: httpx.Response, request: httpx.Request) -> httpx.Response:
    """A closed response the caller may still read status and headers from."""
    return httpx.Response(
        response.status_code, headers=response.headers, content=b"", request=request
    )


class _ReleasingStream(httpx.AsyncByteStream):
    """The response body; closing it gives the request's slot back.

    The slot covers the whole exchange, body included, as the provider counts it.
    """

    def __init__(self, inner: httpx.AsyncByteStream | Any, context: AcquireContext, key: _Key):
        self._inner = inner
        self._context: AcquireContext | None = context
        self._key = key

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        context, self._context = self._context, None
        if context is None:
            return
        self._key.in_flight -= 1
        try:
            await context.__aexit__(None, None, None)
        finally:
            close = getattr(self._inner, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


class QuotaTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends every request through a :class:`Quota`.

    Wraps ``transport`` (default ``httpx.AsyncHTTPTransport()``), so connection pooling,
    HTTP/2 and proxies stay httpx's business.
    """

    def __init__(self, quota: Quota, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.quota = quota
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.quota.send(request, self.transport)

    async def aclose(self) -> None:
        await self.transport.aclose()
