"""The adapter kit's readers of settings a framework's file hands over unchecked.

Each value comes from YAML or TOML someone wrote: a quoted ``"false"`` (``bool`` made it
true), ``min: 1.9`` (``int`` made it 1), ``max: .inf`` (``int`` raised OverflowError,
which no handler caught). Each is a ConfigError naming where it came from (a review).
"""

from __future__ import annotations

import math

import pytest

from tangram import Elastic
from tangram.config import ConfigError
from tangram.integrations import count_of, cpu_demand, flag_of, seconds_of, text_of

WHERE = "[adapters.toy] `x`"


@pytest.mark.parametrize(
    "value",
    [
        {"max": math.inf},
        {"max": 10**400},
        {"min": 1.9, "max": 4},
        {"min": 1, "max": 4.0},
        {"min": True, "max": 4},
        {"max": "4"},
        {"min": 1},
        {"min": 4, "max": 2},
        {"max": 4, "resizable": "false"},
        {"max": 4, "resizable": 1},
        {"max": 4, "cores": 2},
        1.5,
        0,
        True,
        "2",
    ],
)
def test_cpu_demand_refuses_what_is_not_one(value: object) -> None:
    with pytest.raises(ConfigError, match=r"\[adapters.toy\]"):
        cpu_demand(value, "[adapters.toy]")


def test_cpu_demand_reads_what_is() -> None:
    assert cpu_demand(2, "x") == 2
    assert cpu_demand({"max": 4}, "x") == Elastic(1, 4)
    assert cpu_demand({"min": 2, "max": 4, "resizable": True}, "x") == Elastic(2, 4, resizable=True)


@pytest.mark.parametrize(
    ("read", "good", "bad"),
    [
        (flag_of, [True, False], ["false", "no", 0, 1, None]),
        (seconds_of, [None, 0.5, 30, 10**6], ["30", 0, -1, math.inf, math.nan, True, 10**400]),
        (count_of, [1, 4], ["four", 0, -1, 1.0, True, None]),
        (text_of, ["run_code"], ["", 7, None, ["a"]]),
    ],
)
def test_each_reader_takes_its_type_only(
    read: object, good: list[object], bad: list[object]
) -> None:
    assert callable(read)
    for value in good:
        got = read(value, WHERE)
        assert got == value and (value is None or type(got) in (type(value), float))
    for value in bad:
        with pytest.raises(ConfigError, match=r"\[adapters.toy\] `x`"):
            read(value, WHERE)
