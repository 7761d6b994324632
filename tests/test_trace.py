"""Reading tangram-trace/1: every documented field, and a line number for every mistake."""

from __future__ import annotations

import json
import math
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
        # What the simulator used to meet halfway through a run, with no line (a review):
        (json.dumps(action(min=1, max=10**30)), "`max` must be at most 2**53"),
        (json.dumps(action(resource="search_api", min=1, max=100)), "takes `units`"),
        (json.dumps(action(mem_gib=100)), "more than the capacity's `mem` 64"),
        (json.dumps(action(resource="mem", min=2, max=2, mem_gib=1)), "not `mem_gib` too"),
        (json.dumps(action(service="judge")), "needs `resource` gpu"),
        (json.dumps(action(resource="gpu", min=2, max=2, service="judge")), "1 GPUs (got 2"),
        # A time past the clock's precision rounded the runs after it away (ACT 0):
        (json.dumps(action(gap=1e308)), "`gap` must be at most 1e+07"),
        (json.dumps({**action(), "seconds_at_1": 1e8}), "`seconds_at_1` must be at most 1e+07"),
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
    # A null name became the trace named "None" (a review).
    with pytest.raises(TraceFormatError, match="line 1: `name` must be a string"):
        read_trace([json.dumps({**HEADER, "name": None})])
    long_restore = {**HEADER, "services": {"judge": {"restore_seconds": 1e308}}}
    with pytest.raises(TraceFormatError, match="`restore_seconds` must be at most"):
        read_trace([json.dumps(long_restore)])


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
        ({"gpus": 3}, "needs 3 GPUs, more than the capacity's 2"),
        ({"gpu_mem_gib": 81}, "more than its GPUs hold (80 GiB each"),
    ],
)
def test_bad_services_are_rejected(spec: dict[str, object], reason: str) -> None:
    with pytest.raises(TraceFormatError, match="line 1: ") as info:
        read_trace(lines(header={**HEADER, "services": {"judge": spec}}))
    assert reason in str(info.value)


def test_a_service_needs_a_name() -> None:
    """An empty name read as "no service" in the GPU reference, which raised KeyError."""
    with pytest.raises(TraceFormatError, match="line 1: a service needs a non-empty name"):
        read_trace(lines(header={**HEADER, "services": {"": {}}}))


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


def test_a_binary_file_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(json.dumps(HEADER).encode() + b"\n\x89PNG\r\n\x1a\n\xff\xfe\x00junk\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert info.value.line == 2
    assert str(info.value) == f"line 2: not UTF-8 text (byte 1 is b'\\x89') (in {path})"


def test_the_error_carries_the_file_apart_from_its_message(tmp_path: Path) -> None:
    """A tool reading many traces tells which failed from ``.path``, not by parsing text;
    lines given directly have no file, and the attributes survive pickling (Ray workers)."""
    import pickle

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(HEADER) + "\n{\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert (info.value.path, info.value.line) == (str(path), 2)
    assert info.value.reason.startswith("not JSON")
    assert str(info.value) == f"line 2: {info.value.reason} (in {path})"
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.path, copy.line, str(copy)) == (str(path), 2, str(info.value))
    with pytest.raises(TraceFormatError) as direct:
        read_trace([json.dumps(HEADER), "{"])
    assert direct.value.path is None
    assert str(direct.value) == f"line 2: {direct.value.reason}"


@pytest.mark.parametrize(
    "field",
    [
        '"gap": 1' + "0" * 400,
        '"efficiency": {"model": "table", "speedup": [1, 1' + "0" * 400 + "]}",
    ],
)
def test_integers_past_any_float_are_rejected(field: str) -> None:
    line = json.dumps(action())[:-1] + ", " + field + "}"
    with pytest.raises(TraceFormatError, match=r"^line 2: `(gap|efficiency)`") as info:
        read_trace([json.dumps(HEADER), line])
    assert len(str(info.value)) < 200


def test_deep_nesting_and_long_integers_are_format_errors_not_crashes() -> None:
    deep = '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(TraceFormatError, match=r"^line 2: not JSON .*nested too deeply"):
        read_trace([json.dumps(HEADER), deep])
    long = json.dumps(action()).replace('"gap": 1.0', '"gap": ' + "9" * 5000)
    with pytest.raises(TraceFormatError, match=r"^line 2: not JSON .*digits"):
        read_trace([json.dumps(HEADER), long])


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_rejected_where_a_number_is_read(value: str) -> None:
    line = json.dumps(action()).replace('"gap": 1.0', f'"gap": {value}')
    with pytest.raises(TraceFormatError, match=r"^line 2: `gap` must be finite and >= 0"):
        read_trace([json.dumps(HEADER), line])
    header = json.dumps(HEADER).replace('"cpu": 8', f'"cpu": {value}')
    with pytest.raises(TraceFormatError, match=r"^line 1: `cpu` must be finite"):
        read_trace([header])


def test_a_quoted_bad_value_is_cut_short() -> None:
    with pytest.raises(TraceFormatError) as info:
        read_trace([json.dumps(HEADER), json.dumps(action(kind=["x" * 10_000]))])
    assert len(str(info.value)) < 150
    assert str(info.value).endswith("...)")


def test_errors_from_a_file_name_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(HEADER) + "\n{not json\n")
    with pytest.raises(TraceFormatError, match=rf"^line 2: not JSON .* \(in {path}\)$"):
        read_trace(path)
    path.write_text("")
    with pytest.raises(TraceFormatError, match=rf"^the trace is empty.* \(in {path}\)$"):
        read_trace(path)


def test_a_header_only_trace_is_read_with_no_actions() -> None:
    trace = read_trace([json.dumps(HEADER)])
    assert trace.actions == 0
    assert trace.workload() == {}


def _json_values() -> st.SearchStrategy[object]:
    scalars = st.none() | st.booleans() | st.text(max_size=8)
    # Integers past any float and floats at the edges of their range, too.
    edges = st.sampled_from([10**400, -(10**400), 1e308, 5e-324, -0.0])
    numbers = st.integers() | st.floats(allow_nan=True, allow_infinity=True) | edges
    return st.recursive(
        scalars | numbers,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
        max_leaves=12,
    )


_FIELDS = ["trajectory", "index", "gap", "kind", "resource", "units", "min", "max"]
_FIELDS += ["seconds", "seconds_at_1", "efficiency", "service", "mem_gib"]


def _efficiencies() -> st.SearchStrategy[object]:
    """Efficiency objects of every model, their parameters drawn from any JSON value."""
    params = st.fixed_dictionaries(
        {"model": st.sampled_from(["amdahl", "power", "linear", "table", "magic"])},
        optional={
            "parallel_fraction": _json_values(),
            "alpha": _json_values(),
            "speedup": st.lists(_json_values(), max_size=4) | _json_values(),
        },
    )
    return params | _json_values()


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(_FIELDS), _json_values(), max_size=len(_FIELDS))
    | st.fixed_dictionaries({"efficiency": _efficiencies()}),
    st.booleans(),
)
def test_any_json_fields_are_read_or_rejected_with_the_line(
    fields: dict[str, object], on_header: bool
) -> None:
    """Valid actions with fields overwritten by any JSON values (NaN, inf, 10**400)."""
    if on_header:
        header = {**HEADER, "capacity": {**HEADER["capacity"], **fields}}  # type: ignore[dict-item]
        text = lines(action(), header=header)
    else:
        text = lines({**action(), **fields})
    try:
        trace = read_trace(text)
    except TraceFormatError as exc:
        assert exc.line == (1 if on_header else 2)
    else:
        for step in trace.workload()["t0"]:
            assert math.isfinite(step.seconds_at_1) and math.isfinite(step.gap)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_are_read_or_rejected_with_a_typed_error(junk: bytes) -> None:
    try:
        trace = read_trace([json.dumps(HEADER).encode(), *junk.splitlines(keepends=True)])
    except TraceFormatError as exc:
        assert exc.line >= 2
    else:
        assert trace.actions >= 0
