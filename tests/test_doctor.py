"""``tangram doctor``: reports what the host offers and never fails on a missing piece."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import tangram._tools._cli as cli
import tangram._tools._doctor as doctor


def test_reports_this_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor"]) == 0
    text = capsys.readouterr().out
    usable = len(os.sched_getaffinity(0))
    assert text.startswith("This host offers:\n")
    assert f"  cores       {usable} usable of {os.cpu_count()} online" in text
    assert "tangram bench will use:" in text
    assert f"  trajectories   {3 * usable}" in text
    torch = sys.modules.get("torch") or __import__("torch")
    assert f"  torch       {torch.__version__}" in text


@pytest.mark.parametrize(
    ("entries", "expected"),
    [(["cgroup.controllers"], "v2"), (["cpu", "cpuacct"], "v1"), ([], "none found")],
)
def test_cgroup_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, entries: list[str], expected: str
) -> None:
    for name in entries:
        (tmp_path / name).mkdir()
    monkeypatch.setattr(doctor, "CGROUP_ROOT", tmp_path)
    assert doctor.diagnose()["cgroup"] == expected


def test_missing_optional_pieces_are_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("pynvml", "ray", "matplotlib", "aiodocker", "tangram._sandbox._docker._backend"):
        monkeypatch.setitem(sys.modules, name, None)

    def broken() -> str:
        raise PermissionError("/proc/meminfo: denied")

    monkeypatch.setattr(doctor, "_memory", broken)
    facts = doctor.diagnose()
    assert facts["gpus"] == "NVML not installed (pip install nvidia-ml-py)"
    assert facts["ray"] == "not installed (pip install ray)"
    assert facts["matplotlib"] == "not installed (the plot extra)"
    assert facts["docker"].startswith("not usable: aiodocker is not installed")
    assert facts["memory"] == "unknown (PermissionError: /proc/meminfo: denied)"
    assert "unknown (PermissionError" in doctor.format_diagnosis(facts)


def test_docker_reachable_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import tangram._sandbox._docker._backend as docker

    async def usable() -> bool:
        return True

    monkeypatch.setattr(docker, "docker_usable", usable)
    facts = doctor.diagnose()
    assert facts["docker"] == "reachable, image tangram-sandbox-test:latest present"
    assert facts["bench"]["sandbox"] == "local (pass --sandbox docker to use the daemon)"


def test_local_isolation_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "local sandboxes isolate:\n" in text
    for name in ("identity", "namespaces", "memory", "processes"):
        assert f"\n  {name:<11} " in text.split("local sandboxes isolate:")[1]


def test_missing_isolation_tools_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import tangram._sandbox._local._backend as local

    monkeypatch.setattr(local, "bwrap_candidates", lambda **_: [])
    monkeypatch.setattr(local, "open_tree", lambda: "no cgroup memory controller is mounted")
    facts = doctor.diagnose()["local sandbox"]
    assert facts["namespaces"].startswith("off: bubblewrap is not installed (pip install")
    assert facts["memory"] == "per process only (RLIMIT_AS): no cgroup memory controller is mounted"
    off = facts["off"]
    assert any(line.startswith("namespaces: off: bubblewrap is not installed") for line in off)
    assert any(line.startswith("memory: per process only") for line in off)
    text = doctor.format_diagnosis(doctor.diagnose())
    assert "local sandboxes are NOT isolated in:\n  namespaces: off: bubblewrap" in text
