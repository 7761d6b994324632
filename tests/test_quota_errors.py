"""Every mistake a caller can make through ``tangram.quota`` fails at the call that made it.

Each is a :class:`~tangram.errors.TangramError` that is also the builtin a caller would
catch, and its message names the argument, shows the value and says what is allowed. A
bad request is refused before it takes a slot or reaches the server (the loopback
:class:`~tangram.testing.QuotaServer` counts what arrived).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AsyncExitStack

import pytest

import tangram
from tangram.errors import (
    DemandTypeError,
    InvalidCapacityError,
    InvalidDemandError,
    SettingTypeError,
    TangramError,
)
from tangram.quota import Adapt, ApiKey, Quota, Retry, SetAside
from tangram.testing import Limit, QuotaServer

_KEY = ApiKey(name="k", requests=10)
_RANGE = InvalidCapacityError
_TYPE = SettingTypeError

# (what is built, the error it raises, fragments its message must hold): a value of the wrong
# type is a SettingTypeError (a TypeError and a ValueError), one out of range an
# InvalidCapacityError (a ValueError only), so ``except TypeError`` tells them apart.
_SETTINGS: list[tuple[str, Callable[[], object], type[TangramError], tuple[str, ...]]] = [
    ("key name ''", lambda: ApiKey(name="", requests=1), _RANGE, ("`name`", "''")),
    ("key name 3", lambda: ApiKey(name=3, requests=1), _TYPE, ("`name`", "3")),  # type: ignore[arg-type]
    ("no limit", lambda: ApiKey(name="k"), _RANGE, ("'k'", "`requests`")),
    ("rate -5", lambda: ApiKey(name="k", requests=-5), _RANGE, ("`requests`", "-5", "> 0")),
    ("rate 0/s", lambda: ApiKey(name="k", requests="0/s"), _RANGE, ("`requests`", "'0/s'")),
    ("rate -1/s", lambda: ApiKey(name="k", requests="-1/s"), _RANGE, ("`requests`", "-1/s")),
    ("rate nan", lambda: ApiKey(name="k", tokens=math.nan), _RANGE, ("`tokens`", "nan")),
    ("rate inf", lambda: ApiKey(name="k", tokens=math.inf), _RANGE, ("`tokens`", "inf")),
    ("rate fast", lambda: ApiKey(name="k", requests="fast"), _RANGE, ("`requests`", "'50/s'")),
    ("rate True", lambda: ApiKey(name="k", requests=True), _TYPE, ("`requests`", "True")),
    ("slots 0", lambda: ApiKey(name="k", concurrency=0), _RANGE, ("`concurrency`", "0")),
    ("slots 1.5", lambda: ApiKey(name="k", concurrency=1.5), _TYPE, ("`concurrency`", "1.5")),
    (
        "headers 3",
        lambda: ApiKey(name="k", requests=1, headers=3),  # type: ignore[arg-type]
        _TYPE,
        ("`headers`", "3", "Authorization"),
    ),
    (
        "header value 1",
        lambda: ApiKey(name="k", requests=1, headers={"X-Key": 1}),  # type: ignore[dict-item]
        _TYPE,
        ("`headers`", "'X-Key': 1"),
    ),
    (
        "url nope",
        lambda: ApiKey(name="k", requests=1, url="nope"),
        _RANGE,
        ("`url`", "'nope'", "https://"),
    ),
    (
        "url ftp",
        lambda: ApiKey(name="k", requests=1, url="ftp://x"),
        _RANGE,
        ("`url`", "ftp://x"),
    ),
    ("keys []", lambda: Quota([]), _RANGE, ("`keys`", "[]", "ApiKey")),
    ("keys one", lambda: Quota(_KEY), _TYPE, ("`keys`", "list of ApiKey")),  # type: ignore[arg-type]
    ("keys twice", lambda: Quota([_KEY, _KEY]), _RANGE, ("unique", "['k', 'k']")),
    ("quota name", lambda: Quota([_KEY], name=""), _RANGE, ("`name`", "''")),
    ("headroom 0", lambda: Quota([_KEY], headroom=0), _RANGE, ("`headroom`", "0", "<= 1")),
    ("headroom x", lambda: Quota([_KEY], headroom="x"), _TYPE, ("`headroom`", "'x'")),  # type: ignore[arg-type]
    ("jitter -1", lambda: Quota([_KEY], jitter=-1), _RANGE, ("`jitter`", "-1", ">= 0")),
    ("deadline -1", lambda: Quota([_KEY], deadline=-1), _RANGE, ("`deadline`", "-1", "> 0")),
    ("deadline 0", lambda: Quota([_KEY], deadline=0), _RANGE, ("`deadline`", "0", "> 0")),
    ("deadline nan", lambda: Quota([_KEY], deadline=math.nan), _RANGE, ("`deadline`", "nan")),
    ("deadline x", lambda: Quota([_KEY], deadline="x"), _TYPE, ("`deadline`", "'x'")),  # type: ignore[arg-type]
    (
        "estimate 3",
        lambda: Quota([_KEY], estimate_tokens=3),  # type: ignore[arg-type]
        _TYPE,
        ("`estimate_tokens`", "3", "function"),
    ),
    ("retry 3", lambda: Quota([_KEY], retry=3), _TYPE, ("`retry`", "3", "Retry")),  # type: ignore[arg-type]
    ("adapt {}", lambda: Quota([_KEY], adapt={}), _TYPE, ("`adapt`", "{}", "Adapt")),  # type: ignore[arg-type]
    ("aside 1", lambda: Quota([_KEY], set_aside=1), _TYPE, ("`set_aside`", "SetAside")),  # type: ignore[arg-type]
    ("attempts 0", lambda: Retry(attempts=0), _RANGE, ("`attempts`", "0", ">= 1")),
    ("wait_max -1", lambda: Retry(wait_max=-1), _RANGE, ("`wait_max`", "-1", "> 0")),
    ("wait x", lambda: Retry(wait_initial="x"), _TYPE, ("`wait_initial`", "'x'")),  # type: ignore[arg-type]
    ("methods str", lambda: Retry(methods="GET"), _TYPE, ("`methods`", "'GET'", "{'GET'")),
    ("method G ET", lambda: Retry(methods={"G ET"}), _RANGE, ("`methods`", "'G ET'")),
    ("method 1", lambda: Retry(methods={1}), _TYPE, ("`methods`", "1", "'GET'")),  # type: ignore[arg-type]
    ("key flag", lambda: Retry(idempotency_key=1), _TYPE, ("`idempotency_key`", "1")),  # type: ignore[arg-type]
    ("decrease 2", lambda: Adapt(decrease=2), _RANGE, ("`decrease`", "2", "<= 1")),
    ("above 0.5", lambda: Adapt(above=0.5), _RANGE, ("`above`", "0.5", ">= 1")),
    ("failures 0", lambda: SetAside(failures=0), _RANGE, ("`failures`", "0", ">= 1")),
    ("cooldown -1", lambda: SetAside(cooldown=-1), _RANGE, ("`cooldown`", "-1", "> 0")),
]


@pytest.mark.parametrize(
    ("build", "error", "fragments"),
    [pytest.param(b, e, f, id=i) for i, b, e, f in _SETTINGS],
)
def test_a_bad_setting_fails_where_it_is_made(
    build: Callable[[], object], error: type[TangramError], fragments: tuple[str, ...]
) -> None:
    with pytest.raises(TangramError) as caught:
        build()
    assert type(caught.value) is error
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, TypeError) == (error is SettingTypeError)
    for fragment in fragments:
        assert fragment in str(caught.value)


# (the request's extensions or method, the error, fragments its message must hold)
_REQUESTS: list[tuple[str, dict[str, object], str, type[Exception], tuple[str, ...]]] = [
    ("tokens -1", {"tangram.tokens": -1}, "GET", InvalidDemandError, ("tangram.tokens", "-1")),
    ("tokens x", {"tangram.tokens": "x"}, "GET", DemandTypeError, ("tangram.tokens", "'x'")),
    ("tokens nan", {"tangram.tokens": math.nan}, "GET", InvalidDemandError, ("nan", ">= 0")),
    ("deadline 0", {"tangram.deadline": 0}, "GET", InvalidDemandError, ("deadline", "0", "> 0")),
    ("deadline x", {"tangram.deadline": "x"}, "GET", DemandTypeError, ("deadline", "'x'")),
    (
        "idempotent 1",
        {"tangram.idempotent": 1},
        "POST",
        DemandTypeError,
        ("tangram.idempotent", "1", "True or False"),
    ),
    ("method G ET", {}, "G ET", InvalidDemandError, ("method", "'G ET'", "'POST'")),
    ("method ''", {}, "", InvalidDemandError, ("method", "''", "'GET'")),
]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("extensions", "method", "error", "fragments"),
    [pytest.param(x, m, e, f, id=i) for i, x, m, e, f in _REQUESTS],
)
async def test_a_bad_request_fails_at_the_call_and_takes_nothing(
    extensions: dict[str, object], method: str, error: type[Exception], fragments: tuple[str, ...]
) -> None:
    key = ApiKey(name="k", requests=10, tokens=1000, concurrency=1)
    quota = Quota([key])
    async with QuotaServer(Limit()) as server, AsyncExitStack() as stack:
        runtime = await stack.enter_async_context(tangram.Runtime(capacity=quota.capacity()))
        client = await stack.enter_async_context(quota.client(base_url=server.url))
        with pytest.raises(error) as caught:
            await client.request(method, "/v1", extensions=extensions)
        assert runtime.stats().resources["api.k.concurrency"].held == 0
        assert quota.stats()["k"].sent == 0
    assert isinstance(caught.value, TangramError)
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert server.accepted == [] and server.rejected == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_bad_token_estimate_names_the_function() -> None:
    quota = Quota([ApiKey(name="k", tokens=1000)], estimate_tokens=lambda request: "many")  # type: ignore[arg-type,return-value]
    async with QuotaServer(Limit()) as server, AsyncExitStack() as stack:
        await stack.enter_async_context(tangram.Runtime(capacity=quota.capacity()))
        client = await stack.enter_async_context(quota.client(base_url=server.url))
        with pytest.raises(DemandTypeError, match=r"estimate_tokens\(request\).*'many'"):
            await client.get("/v1")
    assert server.accepted == []
