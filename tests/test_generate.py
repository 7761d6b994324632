"""Synthetic traces: they read back, keep their documented shape, and repeat byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

import tangram
from tangram._sim._baselines import run_policy
from tangram._sim._generate import WORKLOADS, GenerateConfig, generate
from tangram._tools._cli import main


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("burst", [False, True])
def test_generated_traces_read_back(workload: str, burst: bool) -> None:
    config = GenerateConfig(workload=workload, batch=24, seed=5, pareto_burst=burst)
    trace = tangram.read_trace(generate(config).splitlines())
    assert len(trace.trajectories) == 24
    assert trace.name == f"{workload}-24" + ("-pareto-burst" if burst else "")
    assert tangram.simulate(trace.workload(), trace.runtime_capacity()).records
    if burst:
        assert all(actions[0].gap == 0 for actions in trace.trajectories.values())


@pytest.mark.parametrize("workload", WORKLOADS)
def test_same_seed_same_bytes(workload: str) -> None:
    first = generate(GenerateConfig(workload=workload, batch=16, seed=11))
    assert first == generate(GenerateConfig(workload=workload, batch=16, seed=11))
    assert first != generate(GenerateConfig(workload=workload, batch=16, seed=12))


def test_coding_shape_matches_the_paper() -> None:
    # The paper: the environment is busy ~47% of a coding trajectory's life.
    trace = tangram.read_trace(
        generate(GenerateConfig(workload="coding", batch=200, seed=0)).splitlines()
    )
    busy = sum(a.seconds_at_1 for acts in trace.trajectories.values() for a in acts)
    gaps = sum(a.gap for acts in trace.trajectories.values() for a in acts)
    assert 0.4 < busy / (busy + gaps) < 0.56
    assert trace.capacity == {"cpu": 200}
    assert all(len(actions) == 20 for actions in trace.trajectories.values())
    kinds = {a.kind for acts in trace.trajectories.values() for a in acts}
    assert kinds == {"shell", "run_tests", "build"}


def test_deepsearch_and_mopd_shapes() -> None:
    search = tangram.read_trace(
        generate(GenerateConfig(workload="deepsearch", batch=32, seed=0)).splitlines()
    )
    assert "search_api_concurrency" in search.capacity
    for actions in search.trajectories.values():
        assert [a.kind for a in actions][-1] == "judge"
        assert actions[-1].service == "judge"
        assert {a.resource for a in actions[:-1]} == {"search_api"}
    mopd = tangram.read_trace(
        generate(GenerateConfig(workload="mopd", batch=300, seed=0)).splitlines()
    )
    assert len(mopd.services) == 9
    counts: dict[str, int] = {}
    for actions in mopd.trajectories.values():
        counts[actions[0].service or ""] = counts.get(actions[0].service or "", 0) + 1
    # Zipf popularity: the first teacher is the most used, by a wide margin.
    assert counts["teacher0"] > 3 * counts.get("teacher8", 0)


def _read(config: GenerateConfig) -> tangram.Trace:
    return tangram.read_trace(generate(config).splitlines())


def test_contended_coding_is_the_pareto_burst_on_less_capacity() -> None:
    contended = GenerateConfig(workload="coding", batch=400, seed=2, contended=True)
    burst = GenerateConfig(workload="coding", batch=400, seed=2, pareto_burst=True)
    # The same actions as the Pareto burst, on 0.3 cores per trajectory.
    assert generate(contended).splitlines()[1:] == generate(burst).splitlines()[1:]
    trace = _read(contended)
    assert trace.name == "coding-400-contended"
    assert trace.capacity == {"cpu": 120}
    assert all(actions[0].gap == 0 for actions in trace.trajectories.values())
    assert _read(GenerateConfig(workload="coding", batch=2, contended=True)).capacity["cpu"] == 1


def test_contended_deepsearch_gives_the_api_half_its_demand() -> None:
    plain = _read(GenerateConfig(workload="deepsearch", batch=256, seed=0))
    contended = _read(GenerateConfig(workload="deepsearch", batch=256, seed=0, contended=True))
    assert contended.capacity["search_api"] == 17
    assert contended.capacity["search_api_concurrency"] == 26
    assert contended.trajectories == plain.trajectories
    # Half the demand, measured: calls a second over the first 30 s of the trace with no
    # queueing (the bound).
    bound = run_policy("bound", contended).records
    early = [r for r in bound if r.kind == "search" and r.arrival < 30.0]
    assert 0.4 < contended.capacity["search_api"] / (len(early) / 30.0) < 0.6


def test_contended_mopd_has_ten_gpus_one_request_a_replica() -> None:
    trace = _read(GenerateConfig(workload="mopd", batch=64, seed=0, contended=True))
    assert trace.capacity == {"gpu": 10}
    specs = trace.gpu_services()
    assert {s.max_batch for s in specs.values()} == {1}
    restores = sorted(s.restore_seconds for s in specs.values())
    assert restores[0] == 2.0 and restores[-1] == 4.0
    plain = _read(GenerateConfig(workload="mopd", batch=64, seed=0))
    assert plain.trajectories == trace.trajectories


def test_the_zipf_exponent_skews_the_teachers_and_is_recorded() -> None:
    def shares(zipf: float) -> list[int]:
        trace = _read(GenerateConfig(workload="mopd", batch=512, seed=0, zipf=zipf))
        counts = {f"teacher{rank}": 0 for rank in range(9)}
        for actions in trace.trajectories.values():
            counts[actions[0].kind] += 1
        return list(counts.values())

    flat, default, steep = shares(0.5), shares(1.1), shares(2.0)
    assert flat[0] < default[0] < steep[0]
    assert flat[-1] > steep[-1]
    assert default == shares(1.1)
    default_text = generate(GenerateConfig(workload="mopd", batch=4))
    assert '"zipf"' not in default_text.splitlines()[0]
    header = generate(GenerateConfig(workload="mopd", batch=4, zipf=0.8)).splitlines()[0]
    assert '"zipf": 0.8' in header


@pytest.mark.parametrize(
    "kwargs",
    [
        {"workload": "chess", "batch": 4},
        {"workload": "coding", "batch": 0},
        {"workload": "coding", "batch": 4, "turns": 0},
        {"workload": "mopd", "batch": 4, "zipf": 0},
        {"workload": "mopd", "batch": 4, "zipf": "1"},
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GenerateConfig(**kwargs)  # type: ignore[arg-type]


def test_cli_contended(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    argv = ["trace", "generate", "--workload", "coding", "--batch", "10", "--contended"]
    assert main([*argv, "--out", str(out)]) == 0
    config = GenerateConfig(workload="coding", batch=10, contended=True)
    assert out.read_bytes() == generate(config).encode()


def test_cli_writes_the_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    argv = ["trace", "generate", "--workload", "mopd", "--batch", "8", "--seed", "3"]
    assert main([*argv, "--out", str(out)]) == 0
    expected = generate(GenerateConfig(workload="mopd", batch=8, seed=3))
    assert out.read_bytes() == expected.encode()
    assert main(argv) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "generate", "--workload", "chess", "--batch", "4"],
        ["trace", "generate", "--workload", "coding", "--batch", "0"],
        ["trace", "generate", "--workload", "coding"],
        ["trace"],
    ],
)
def test_cli_bad_args_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
