"""Reading tangram-trace/1: every documented field, and a line number for every mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tangram
from tangram import Amdahl, Elastic, Linear, Rate, read_trace
from tangram._sim._residency import ServiceSpec
from tangram.errors import TangramError, TraceFormatError

HEADER = {
    "format": "tangram-trace/1",
    "name": "tiny",
    "capacity": {"cpu": 8, "gpu": 2, "mem": 64, "search_api": 5, "search_api_concurrency": 2},
    "services": {"judge": {"gpus": 1, "gpu_mem_gib": 40, "restore_seconds": 1.5}},
}


def lines(*actions: dict[str, object], header: dict[str, object] = HEADER) -> list[str]:
    return [json.dumps(header), *(json.dumps(a) for a in actions)]


def action(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "trajectory": "t0",
        "index": 0,
        "gap": 1.0,
        "kind": "run_tests",
        "resource": "cpu",
        "min": 1,
        "max": 4,
        "seconds_at_1": 8.0,
        "efficiency": {"model": "amdahl", "parallel_fraction": 0.9},
        "mem_gib": 2,
    }
    base.update(fields)
    return base


def test_reads_every_documented_field_and_orders_by_index(tmp_path: Path) -> None:
    text = lines(
        action(index=1, gap=0.5, kind="build"),
        action(),
        action(
            trajectory="t1",
            resource="gpu",
            units=1,
            service="judge",
            seconds=2.0,
            seconds_at_1=None,
            min=None,
            max=None,
            efficiency=None,
            mem_gib=None,
        ),
        action(
            trajectory="t1",
            index=1,
            resource="search_api",
            units=1,
            seconds=0.3,
            seconds_at_1=None,
            min=None,
            max=None,
            efficiency=None,
            mem_gib=None,
            extra="kept and ignored",
        ),
    )
    cleaned = [
        json.dumps({k: v for k, v in json.loads(line).items() if v is not None}) for line in text
    ]
    path = tmp_path / "tiny.jsonl"
    path.write_text("# a comment\n\n" + "\n".join(cleaned) + "\n")
    trace = read_trace(path)
    assert trace.name == "tiny"
    assert trace.gpu_mem_gib_per_device == 80
    assert trace.actions == 4
    t0 = trace.trajectories["t0"]
    assert [a.kind for a in t0] == ["run_tests", "build"]
    assert t0[0].efficiency == Amdahl(0.9)
    assert t0[0].line == 5  # comment and blank line counted
    gpu, api = trace.trajectories["t1"]
    assert (gpu.service, gpu.min, gpu.max, gpu.seconds_at_1) == ("judge", 1, 1, 2.0)
    assert api.efficiency == Linear()

    workload = trace.workload()
    first = workload["t0"][0]
    assert first.demand == {
        "cpu": Elastic(1, 4, efficiency=Amdahl(0.9), resizable=True),
        "mem": 2.0,
    }
    assert (first.seconds_at_1, first.gap, first.kind) == (8.0, 1.0, "run_tests")
    assert workload["t1"][0].demand == {"gpu": 1.0}
    assert workload["t1"][1].demand == {"search_api": 1.0, "search_api_concurrency": 1}
    capacity = trace.runtime_capacity({"cpu": 16})
    assert capacity["cpu"] == 16
    assert capacity["search_api"] == Rate(5, burst=5)
    assert capacity["search_api_concurrency"] == 2


def test_a_trace_replays_through_the_simulator() -> None:
    trace = read_trace(lines(action(), action(index=1), action(trajectory="t1")))
    result = tangram.simulate(trace.workload(), trace.runtime_capacity())
    assert len(result.records) == 3
    assert {r.trajectory for r in result.records} == {"t0", "t1"}


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps(action(index=-1)), "`index` must be a whole number"),
        (json.dumps(action(index=True)), "`index` must be a whole number"),
        (json.dumps(action(gap=-1)), "`gap` must be finite and >= 0"),
        (json.dumps(action(resource="tpu")), "not in the header's capacity"),
        (json.dumps(action(min=4, max=2)), "`max` must be >= `min` (got 2 < 4)"),
        (json.dumps(action(min=1.5, max=4)), "must be whole"),
        (json.dumps(action(min=16, max=16)), "more than the capacity 8"),
        (json.dumps(action(units=2)), "not both"),
        (json.dumps({**action(), "seconds_at_1": "long"}), "`seconds_at_1` must be a number"),
        (json.dumps(action(efficiency={"model": "magic"})), "unknown efficiency model"),
        (json.dumps(action(service="teacher")), "not in the header's services"),
        (json.dumps({k: v for k, v in action().items() if k != "kind"}), "needs `kind`"),
        (json.dumps({k: v for k, v in action().items() if k != "max"}), "`units`, or `min`"),
        (json.dumps(action(trajectory="")), "non-empty string"),
    ],
)
def test_malformed_lines_name_their_line_and_reason(bad: str, reason: str) -> None:
    text = [*lines(action()), bad]
    with pytest.raises(TraceFormatError) as info:
        read_trace(text)
    assert info.value.line == 3
    assert reason in str(info.value)
    assert str(info.value).startswith("line 3: ")


def test_header_errors() -> None:
    with pytest.raises(TraceFormatError, match="line 1: the header must say"):
        read_trace([json.dumps({**HEADER, "format": "tangram-trace/2"})])
    with pytest.raises(TraceFormatError, match="non-empty `capacity`"):
        read_trace([json.dumps({**HEADER, "capacity": {}})])
    with pytest.raises(TraceFormatError, match="the trace is empty"):
        read_trace(["# nothing", ""])
    with pytest.raises(TraceFormatError, match="line 3: trajectory 't0' has index 0 twice"):
        read_trace(lines(action(), action()))


def test_services_become_gpu_services_and_service_steps() -> None:
    header = {
        **HEADER,
        "gpu_mem_gib_per_device": 48,
        "services": {
            "judge": {"gpus": 1, "gpu_mem_gib": 40, "restore_seconds": 1.5, "max_batch": 4},
            "bare": {},
        },
    }
    judge = action(kind="judge", resource="gpu", units=1, seconds=0.5, service="judge")
    del judge["min"], judge["max"], judge["seconds_at_1"], judge["efficiency"]
    trace = read_trace(lines(judge, header=header))
    services = trace.gpu_services()
    assert services["judge"] == ServiceSpec(
        name="judge", gpus=1, gpu_mem_gib=40, restore_seconds=1.5, max_batch=4
    )
    # Unset keys: one GPU, a whole device's memory, a free restore, one action at a time.
    assert services["bare"] == ServiceSpec(name="bare", gpus=1, gpu_mem_gib=48)
    assert trace.workload()["t0"][0].service == "judge"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"gpus": 1.5}, "`gpus` must be a whole number >= 1"),
        ({"gpus": 0}, "`gpus` must be a whole number >= 1"),
        ({"max_batch": 0}, "`max_batch` must be a whole number >= 1"),
        ({"max_batch": "many"}, "`max_batch` must be a number"),
        ({"restore_seconds": -1}, "`restore_seconds` must be finite and >= 0"),
    ],
)
def test_bad_services_are_rejected(spec: dict[str, object], reason: str) -> None:
    with pytest.raises(TraceFormatError, match="line 1: ") as info:
        read_trace(lines(header={**HEADER, "services": {"judge": spec}}))
    assert reason in str(info.value)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_line_is_read_or_rejected_with_a_typed_error(junk: str) -> None:
    try:
        trace = read_trace([*lines(action()), junk])
    except TangramError as exc:
        assert isinstance(exc, TraceFormatError)
        assert exc.line in (2, 3)
    else:
        assert trace.actions >= 1
