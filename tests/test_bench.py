"""``tangram bench``: a scaled-down real step end to end, its report, and Ctrl-C cleanup.

Everything here is real: sandboxed subprocesses running generated test suites and builds,
a loopback rate-limited HTTP server, torch reward models behind the GPU-service pool on
the CPU device (the stand-in for a GPU this machine lacks, as in tests/test_gpu.py).
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tangram._tools._cli as cli
from tangram._tools._bench import BenchConfig, MeasuredAction, default_config, make_plan
from tangram._tools._bench_report import live_progress

SMALL = ["--trajectories", "3", "--turns", "2", "--time-scale", "0.2", "--rounds", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _suite_fails(sizes: tuple[int, ...]) -> bool:
    """Whether the buggy draft (sieve stopped one step early) fails one of these tests."""
    return any(_is_prime(math.isqrt(n)) and math.isqrt(n) ** 2 < n for n in sizes)


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    """One in-process run: the report directory, then what it wrote to stdout and stderr."""
    out = tmp_path_factory.mktemp("bench") / "report"  # created by the run
    captures = tmp_path_factory.mktemp("streams")
    with (captures / "out").open("w") as stdout, (captures / "err").open("w") as stderr:
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = stdout, stderr
        try:
            code = cli.main(["bench", *SMALL, "--out", str(out)])
        finally:
            sys.stdout, sys.stderr = saved
    assert code == 0
    yield out, (captures / "out").read_text(), (captures / "err").read_text()


@pytest.fixture(scope="module")
def report(streams: tuple[Path, str, str]) -> tuple[Path, str]:
    return streams[0], streams[1]


def test_results_on_stdout_progress_on_stderr(streams: tuple[Path, str, str]) -> None:
    out, stdout, stderr = streams
    # stdout: the table, then the files written; nothing else.
    assert stdout == (out / "table.txt").read_text() + f"wrote {out / 'report.json'}, " + (
        f"{out / 'act.png'}, {out / 'cores.png'}, {out / 'table.txt'}\n"
    )
    total = 3 * (2 + 1)
    for arm in ("tangram", "static", "verl", "verl 2", "tangram 2"):
        assert f"{arm}: running {total} actions\n" in stderr
        assert f"{arm}: {total}/{total} actions, at " in stderr
    # The second round runs verl first: the first round ran tangram first.
    assert stderr.index("verl 2: running") < stderr.index("tangram 2: running")
    assert "static 2" not in stderr
    assert "avg ACT" not in stderr


def test_report_files_are_written_and_valid(report: tuple[Path, str]) -> None:
    out, stdout = report
    for name in ("act.png", "cores.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        assert 5_000 < len(data) < 200_000
    figures = json.loads((out / "report.json").read_text())
    assert set(figures) == {"bench", "config", "backend", "arms", "rounds", "ratios", "targets"}
    assert figures["backend"] == "local"
    assert set(figures["targets"]) == {
        "step_seconds",
        "avg_act",
        "verl_avg_act",
        "verl_step_seconds",
    }
    assert set(figures["arms"]) == {"tangram", "static", "verl"}
    tangram = figures["arms"]["tangram"]
    # The report keeps six decimals: the ratio of the rounded ACTs is within 1e-3 of it
    # for any ACT above a millisecond.
    ratio = figures["arms"]["static"]["avg_act"] / tangram["avg_act"]
    assert figures["ratios"]["avg_act"] == pytest.approx(ratio, rel=1e-3)
    steps = figures["arms"]["static"]["step_seconds"] / tangram["step_seconds"]
    assert figures["ratios"]["step_seconds"] == pytest.approx(steps, rel=1e-3)
    # verl's: the median (of two rounds, their mean) of each round's own ratio, the
    # first round's being the one of the arms reported in full.
    rounds = figures["rounds"]
    assert len(rounds) == 2
    first = figures["arms"]["verl"]["avg_act"] / tangram["avg_act"]
    assert rounds[0]["ratios"]["verl_avg_act"] == pytest.approx(first, rel=1e-3)
    for metric in ("avg_act", "step_seconds"):
        each = [r["verl"][metric] / r["tangram"][metric] for r in rounds]
        assert [r["ratios"][f"verl_{metric}"] for r in rounds] == pytest.approx(each, rel=1e-3)
        median = (each[0] + each[1]) / 2
        assert figures["ratios"][f"verl_{metric}"] == pytest.approx(median, rel=1e-3)
    assert "static / tangram: avg ACT" in stdout
    assert "verl / tangram: avg ACT" in stdout and "(median of 2 rounds; avg ACT " in stdout
    table = (out / "table.txt").read_text()
    assert table.startswith("tangram bench: 3 trajectories x 2 turns, ")
    assert table in stdout
    assert f"wrote {out / 'report.json'}" in stdout


def test_every_arm_ran_the_same_real_actions(report: tuple[Path, str]) -> None:
    out, _ = report
    figures = json.loads((out / "report.json").read_text())
    config = BenchConfig(**figures["config"])
    plans = {plan.name: plan for plan in make_plan(config)}
    arms = figures["arms"]
    keys = {
        name: [(r["trajectory"], r["turn"], r["kind"]) for r in arm["records"]]
        for name, arm in arms.items()
    }
    assert keys["tangram"] == keys["static"] == keys["verl"]
    assert len(keys["tangram"]) == config.trajectories * (config.turns + 1)
    for name, arm in arms.items():
        assert arm["actions"] == len(arm["records"])
        for record in arm["records"]:
            parts = record["queue"] + record["overhead"] + record["exec"]
            assert record["act"] == pytest.approx(parts, abs=1e-3)
            if record["kind"] not in ("tests", "build"):
                continue
            turn = plans[record["trajectory"]].turns[record["turn"]]
            # The suite really ran: a buggy draft fails exactly when one of its test
            # sizes exposes the bug, and builds always pass.
            expected = "exit 1" if turn.buggy and _suite_fails(turn.sizes) else "ok"
            assert record["outcome"] == expected, (name, record)
            if name == "static":
                assert record["units"] == record["max_units"] == 1
            elif name == "verl":
                # A fixed number of cores per call, never resized.
                assert record["units"] == record["max_units"] == config.call_cores
            else:
                assert 1 <= record["units"] <= record["max_units"] <= config.cores
        # Three reward models, memory for two, three trajectories: two start resident, so
        # the third is restored over one of them, and restoring is measured as the reward
        # actions' overhead.
        assert arm["gpu"]["evictions"] >= 1
        rewards = [r for r in arm["records"] if r["kind"] == "reward"]
        assert sum(r["overhead"] > 0 for r in rewards) >= config.reward_models - 2
        assert arm["gpu"]["restores"] >= config.reward_models - 2
        assert all(held <= config.cores for _, held, _ in arm["timeline"])
    # Same seeded models scoring the same test results: the same rewards in every arm.
    # (Approximately: the pool may batch different calls together in different arms.)
    for name in ("static", "verl"):
        assert arms["tangram"]["rewards"] == pytest.approx(arms[name]["rewards"], abs=2e-4)
    assert set(arms["tangram"]["rewards"]) == set(plans)
    # Static bills its slots for the trajectory's life: never less than the cores busy.
    assert arms["static"]["core_seconds"] >= arms["static"]["busy_core_seconds"]


def test_plan_is_seeded_and_ends_with_tests() -> None:
    config = default_config(cores=2, turns=5)
    assert config.trajectories == 6
    assert make_plan(config) == make_plan(config)
    assert make_plan(config) != make_plan(default_config(cores=2, turns=5, seed=1))
    for plan in make_plan(config):
        assert plan.turns[-1].kind == "tests"
        assert all(turn.gap > 0 for turn in plan.turns)
    with pytest.raises(ValueError, match="`turns` must be a whole number >= 1"):
        BenchConfig(trajectories=2, cores=1, turns=0)
    with pytest.raises(ValueError, match="`reward_models` must be >= 2"):
        BenchConfig(trajectories=2, cores=1, reward_models=1)
    with pytest.raises(ValueError, match="`call_cores` must be <= `cores`"):
        BenchConfig(trajectories=2, cores=1, call_cores=2)


def test_too_many_cores_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    cores = len(os.sched_getaffinity(0))
    assert cli.main(["bench", *SMALL, "--cores", str(cores + 1)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"InvalidCapacityError: --cores {cores + 1}, but this process may use {cores} cores"
    )


def test_out_without_matplotlib_says_which_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["bench", *SMALL, "--out", str(tmp_path)]) == 1
    assert "pip install 'tangram[plot]'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(number: int) -> MeasuredAction:
    return MeasuredAction("t0", number, "tests", 0.5, 0.1, 0.0, 0.4, 2, 2, "ok")


def test_progress_is_live_on_a_terminal_and_plain_otherwise() -> None:
    terminal = _Terminal()
    with live_progress(2, terminal) as hook:
        hook("tangram", None)
        hook("tangram", _record(0))
        hook("tangram", _record(1))
    shown = terminal.getvalue()
    assert "2/2" in shown
    assert "t0 tests: ACT 0.50 s on 2 cores" in shown
    plain = io.StringIO()
    with live_progress(20, plain) as hook:
        hook("static", None)
        for number in range(20):
            hook("static", _record(number))
    lines = plain.getvalue().splitlines()
    assert lines[0] == "static: running 20 actions"
    assert lines[1:] == [f"static: {n}/20 actions, at 1.0 s" for n in range(2, 21, 2)]


def _processes_under(root: Path) -> list[tuple[int, str]]:
    """Processes whose working directory or command line is under ``root``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cwd.startswith(str(root)) or str(root) in cmdline:
            found.append((int(entry.name), f"{cwd}: {cmdline}"))
    return found


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def test_ctrl_c_leaves_no_process_or_temp_dir() -> None:
    """SIGINT mid-step, while sandboxed suites run: exit 130, nothing left behind."""
    root = Path(tempfile.mkdtemp(prefix="tangram-bench-test-"))
    root.chmod(0o755)  # sandbox commands run as an unprivileged user when we are root
    env = {**os.environ, "TMPDIR": str(root)}
    argv = [
        sys.executable,
        "-m",
        "tangram._tools._cli",
        "bench",
        "--trajectories",
        "3",
        "--turns",
        "6",
    ]
    with subprocess.Popen(
        [*argv, "--time-scale", "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stderr is not None
            seen: list[str] = []
            for line in child.stderr:  # progress: plain lines, stderr being a pipe
                seen.append(line)
                done = line.removeprefix("tangram: ").partition("/")[0]
                if done.isdigit() and int(done) >= 3:
                    break
            else:
                pytest.fail(f"the bench ended before the interrupt: {seen}")
            # Mid-step: the trajectories' sandboxes exist as work dirs under our TMPDIR.
            assert any(d.name.startswith("tangram-sbx-") for d in root.iterdir())
            in_step = _children(child.pid) + [p for p, _ in _processes_under(root)]
            child.send_signal(signal.SIGINT)
            stdout, stderr = child.communicate(timeout=60)
            assert child.returncode == 130, stderr
            assert stdout == ""
            assert stderr.strip().endswith("interrupted")
            deadline = time.monotonic() + 5
            left: list[tuple[int, str]] = []
            while time.monotonic() < deadline:
                left = _processes_under(root) + [
                    (p, "a child of the bench") for p in in_step if Path(f"/proc/{p}").exists()
                ]
                if not left:
                    break
                time.sleep(0.1)
            assert not left
            assert list(root.iterdir()) == []
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            shutil.rmtree(root, ignore_errors=True)
