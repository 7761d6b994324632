"""``tangram simulate`` in-process: the table, the JSON of docs/traces.md, plots and errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tangram._sim._family import member
from tangram._sim._generate import GenerateConfig, generate
from tangram._tools._cli import main

KEYS = {
    "avg_act",
    "p50_act",
    "p95_act",
    "p99_act",
    "avg_queue",
    "avg_exec",
    "avg_overhead",
    "step_seconds",
    "unit_seconds",
    "peak_units",
    "actions",
}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "coding.jsonl"
    path.write_text(generate(GenerateConfig(workload="coding", batch=16, seed=4, turns=5)))
    return path


def test_json_has_the_documented_keys(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(trace), "--json", str(out)]
    assert main([*argv, "--policy", "tangram,static,fixed-dop-4,bound"]) == 0
    printed = capsys.readouterr().out
    for name in ("tangram", "static", "fixed-dop-4", "bound", "avg ACT"):
        assert name in printed
    document = json.loads(out.read_text())
    assert document["trace"] == "coding-16"
    assert set(document["policies"]) == {"tangram", "static", "fixed-dop-4", "bound"}
    for summary in document["policies"].values():
        assert set(summary) == KEYS
        assert summary["actions"] == 80
        assert set(summary["unit_seconds"]) == {"cpu"}
    assert document["policies"]["bound"]["avg_act"] <= document["policies"]["tangram"]["avg_act"]


def test_the_admission_references_from_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "contended.jsonl"
    argv = ["trace", "generate", "--workload", "coding", "--batch", "40", "--seed", "1"]
    assert main([*argv, "--contended", "--out", str(path)]) == 0
    out = tmp_path / "r.json"
    policies = "tangram,tangram-fcfs,srpt"
    assert main(["simulate", "--trace", str(path), "--policy", policies, "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["trace"] == "coding-40-contended"
    summaries = document["policies"]
    assert set(summaries) == {"tangram", "tangram-fcfs", "srpt"}
    assert summaries["srpt"]["avg_act"] < summaries["tangram-fcfs"]["avg_act"]


def test_same_trace_same_bytes(trace: Path, tmp_path: Path) -> None:
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outs:
        assert main(["simulate", "--trace", str(trace), "--json", str(out)]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()


def test_capacity_and_static_units_change_the_run(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(trace), "--policy", "static", "--json", str(out)]
    assert main([*argv, "--capacity", "cpu=4", "--static-units", "1"]) == 0
    squeezed = json.loads(out.read_text())["policies"]["static"]
    assert squeezed["peak_units"] == {"cpu": 4}
    assert squeezed["avg_queue"] > 0


@pytest.mark.parametrize(
    "extra", [["--capacity", "cpus=1"], ["--sweep", "capacity.CPU=1,2"]], ids=["capacity", "sweep"]
)
def test_a_capacity_the_trace_has_not_is_refused(
    trace: Path, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo was ignored: the run used the header's capacity, every sweep point alike."""
    assert main(["simulate", "--trace", str(trace), "--policy", "static", *extra]) == 2
    assert "is not the trace's" in capsys.readouterr().err


def test_plot_is_a_png(trace: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "acts.png"
    assert main(["simulate", "--trace", str(trace), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_writes_ratios_and_a_png(trace: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    argv = ["simulate", "--trace", str(trace), "--policy", "tangram,static"]
    argv += ["--sweep", "capacity.cpu=8,16", "--plot", str(png), "--json", str(out)]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["parameter"] == "capacity.cpu"
    assert sweep["values"] == [8, 16]
    assert sweep["reference"] == "tangram"
    assert len(sweep["avg_act_ratio"]["static"]) == 2
    assert set(sweep["points"][0]["policies"]["static"]) == KEYS


def test_missing_matplotlib_says_how_to_install(
    trace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "acts.png"
    assert main(["simulate", "--trace", str(trace), "--plot", str(png)]) == 1
    assert "pip install 'tangram[plot]'" in capsys.readouterr().err
    assert not png.exists()


def test_family_member_is_the_benchmarks_member_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    argv = ["trace", "generate", "--family", "--seed", "7", "--member", "13"]
    assert main([*argv, "--max-trajectories", "24", "--out", str(path)]) == 0
    expected = member(7, 13, max_trajectories=24)
    assert path.read_text() == "".join(expected.lines)
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(path), "--policy", "tangram", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["trace"] == expected.name


def test_family_writes_one_file_per_member(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = tmp_path / "new" / "family"
    argv = ["trace", "generate", "--family", "--seed", "2", "--members", "5"]
    assert main([*argv, "--max-trajectories", "8", "--out-dir", str(where)]) == 0
    names = sorted(path.name for path in where.iterdir())
    drawn = [member(2, index, max_trajectories=8) for index in range(5)]
    assert names == sorted(f"{m.name}.jsonl" for m in drawn)
    for m in drawn:
        assert (where / f"{m.name}.jsonl").read_text() == "".join(m.lines)
    assert capsys.readouterr().out == ""  # progress goes to stderr


@pytest.mark.parametrize(
    "extra",
    [
        [],  # neither --member nor --out-dir
        ["--member", "-1"],
        ["--members", "0", "--out-dir", "x"],
        ["--member", "0", "--members", "2"],
        ["--member", "0", "--out-dir", "x"],
        ["--out-dir", "x", "--out", "y.jsonl"],
        ["--member", "0", "--batch", "4"],
        ["--member", "0", "--contended"],
        ["--member", "0", "--turns", "3"],
        ["--member", "0", "--workload", "coding"],
    ],
)
def test_bad_family_args_exit_2(tmp_path: Path, extra: list[str]) -> None:
    extra = [str(tmp_path / arg) if arg in ("x", "y.jsonl") else arg for arg in extra]
    with pytest.raises(SystemExit) as info:
        main(["trace", "generate", "--family", *extra])
    assert info.value.code == 2


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--batch", "4", "--member", "0"],
        ["--batch", "4", "--max-trajectories", "9"],
        ["--batch", "4", "--max-trajectories", "4096"],  # the family's default, still refused
    ],
)
def test_bad_workload_args_exit_2(extra: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["trace", "generate", "--workload", "coding", *extra])
    assert info.value.code == 2


@pytest.mark.parametrize(
    "extra",
    [
        ["--policy", "k9s"],
        ["--policy", "fixed-dop-0"],
        ["--capacity", "cpu"],
        ["--capacity", "cpu=-1"],
        ["--static-units", "0"],
        ["--sweep", "cpu=1,2"],
        ["--sweep", "capacity.cpu="],
    ],
)
def test_bad_args_exit_2(trace: Path, extra: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--trace", str(trace), *extra])
    assert info.value.code == 2


def test_missing_trace_argument_exits_2() -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate"])
    assert info.value.code == 2


def test_malformed_trace_exits_2_with_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"format": "tangram-trace/1", "capacity": {"cpu": 4}}\n'
        '{"trajectory": "a", "index": 0, "gap": 0, "kind": "k", "resource": "gpu",'
        ' "units": 1, "seconds": 1}\n'
    )
    assert main(["simulate", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("TraceFormatError: line 2: ")
    assert err.endswith(f"(in {bad})\n")


def test_unreadable_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--trace", str(tmp_path / "absent.jsonl")])
    assert info.value.code == 2
    assert "cannot read" in capsys.readouterr().err


def test_k8s_and_its_lag_from_the_command_line(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    acts: list[tuple[dict[str, float], dict[str, float]]] = []
    for lag in ("0", "600"):
        out = tmp_path / f"k8s-{lag}.json"
        argv = ["simulate", "--trace", str(trace), "--policy", "k8s,static", "--json", str(out)]
        assert main([*argv, "--k8s-lag", lag, "--static-units", "1"]) == 0
        policies = json.loads(out.read_text())["policies"]
        assert set(policies["k8s"]) == KEYS
        acts.append((policies["k8s"], policies["static"]))
    # Resizes that land at once let builds grow (and grown pods make new pods queue);
    # resizes that never land in time leave static slots.
    assert acts[0][0]["avg_exec"] < acts[0][1]["avg_exec"]
    assert acts[0][0]["avg_queue"] > acts[0][1]["avg_queue"]
    assert acts[1][0]["avg_act"] == acts[1][1]["avg_act"]
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(trace), "--k8s-lag", "-1"])
    assert "must be >= 0" in capsys.readouterr().err


def test_gpu_restores_are_overhead_in_the_json(tmp_path: Path) -> None:
    path = tmp_path / "mopd.jsonl"
    path.write_text(generate(GenerateConfig(workload="mopd", batch=64, seed=1)))
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outs:
        argv = ["simulate", "--trace", str(path), "--policy", "tangram,static", "--json", str(out)]
        assert main([*argv, "--capacity", "gpu=4"]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    policies = json.loads(outs[0].read_text())["policies"]
    # tangram restores teachers that did not fit (4 GPUs, 9 teachers); static pins each to
    # its share and never does.
    assert policies["tangram"]["avg_overhead"] > 0
    assert policies["static"]["avg_overhead"] == 0
    tangram_, static = policies["tangram"], policies["static"]
    assert tangram_["avg_act"] == pytest.approx(
        tangram_["avg_queue"] + tangram_["avg_exec"] + tangram_["avg_overhead"], rel=1e-4
    )
    assert static["peak_units"]["gpu"] == 9  # one replica each, at least: 9 x 1 GPU
