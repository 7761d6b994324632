"""The ``tangram`` command, run in-process as a user would call it: exit codes and streams.

Every subcommand is called through ``main(argv)``; results must be alone on stdout and
everything else on stderr. ``tangram bench`` runs for real in tests/test_bench.py (its
stream split is checked there); here its arguments are checked before anything runs.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import tangram
import tangram._tools._cli as cli
import tangram._tools._report as report
from tangram._sim._generate import GenerateConfig, generate
from tangram.errors import InvalidDemandError, SandboxBrokenError, TangramError

HEADER = '{"format": "tangram-trace/1", "name": "empty", "capacity": {"cpu": 4}}\n'


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "coding.jsonl"
    path.write_text(generate(GenerateConfig(workload="coding", batch=6, seed=2, turns=3)))
    return path


def _exit_code(argv: list[str]) -> object:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("the run started although its arguments were bad")


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _subparsers(child)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out == f"tangram {tangram.__version__}\n"


def test_every_flag_and_command_has_help() -> None:
    for parser in _subparsers(cli._parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, f"{parser.prog} {choice.dest}"
            else:
                assert action.help, f"{parser.prog} {action.option_strings or action.dest}"


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit codes: 0 done, 1 the run failed" in text
    assert "2 usage or input error" in text


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidDemandError("`max` must be >= `min` (got 2 < 4)"), 2),
        (SandboxBrokenError("the sandbox died"), 1),
    ],
)
def test_tangram_errors_print_type_and_message(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: TangramError,
    code: int,
) -> None:
    """What the caller gave exits 2; an outside cause exits 1; stdout stays empty."""

    def broken(args: argparse.Namespace) -> int:
        raise error

    monkeypatch.setattr(cli, "_bench", broken)
    assert cli.main(["bench"]) == code
    captured = capsys.readouterr()
    assert captured.err == f"{type(error).__name__}: {error}\n"
    assert captured.out == ""


def test_ctrl_c_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_doctor", interrupted)
    assert cli.main(["doctor"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize(
    "bad",
    [
        ["bench", "--cores", "0"],
        ["bench", "--time-scale", "-1"],
        ["bench", "--sandbox", "vm"],
        ["demo"],
        [],
        ["doctor", "--jsn"],
        ["trace", "generate", "--workload", "coding", "--batch", "0"],
        ["serve-sandbox-fusion", "--cpu", "0"],
    ],
)
def test_bad_arguments_exit_2_with_usage_on_stderr(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(bad) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: tangram" in captured.err


# -- unwritable outputs fail before the run ------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--json", "{tmp}/missing-dir/r.json"],
        ["simulate", "--json", "{tmp}/a-file/r.json"],
        ["simulate", "--json", "{tmp}"],
        ["simulate", "--plot", "{tmp}/missing-dir/acts.svg"],
        ["simulate", "--plot", "{tmp}/a-file/acts.png"],
        ["trace", "generate", "--workload", "coding", "--batch", "4", "--out", "{tmp}/no/t.jsonl"],
        ["trace", "generate", "--workload", "coding", "--batch", "4", "--out", "{tmp}"],
        ["bench", "--out", "{tmp}/a-file/report"],
        ["bench", "--out", "{tmp}/a-file"],
    ],
)
def test_unwritable_outputs_fail_before_the_run(
    argv: list[str],
    trace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(report, "run_policy", _never)
    monkeypatch.setattr(report, "generate_lines", _never)
    monkeypatch.setattr("tangram._tools._bench.run_bench", _never)
    argv = [part.format(tmp=tmp_path) for part in argv]
    flag = argv[-2]
    if argv[0] == "simulate":
        argv += ["--trace", str(trace)]
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"error: argument {flag}: cannot " in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "coding.jsonl"]


def test_an_existing_output_is_kept_until_written(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writability probe neither truncates an old result nor leaves a new empty one."""
    old = tmp_path / "old.json"
    old.write_text("previous result")

    def failing(*args: object, **kwargs: object) -> None:
        raise SandboxBrokenError("gone")

    monkeypatch.setattr(report, "run_policy", failing)
    new = tmp_path / "new.json"
    for out in (old, new):
        assert cli.main(["simulate", "--trace", str(trace), "--json", str(out)]) == 1
    assert old.read_text() == "previous result"
    assert not new.exists()


def test_bench_out_must_be_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("tangram._tools._bench.run_bench", _never)
    (tmp_path / "report.json").write_text("")
    assert _exit_code(["bench", "--out", str(tmp_path / "report.json")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert _exit_code(["bench", "--out", "-"]) == 2


# -- trace generate and simulate -----------------------------------------------------------


def test_trace_generate_writes_to_stdout_or_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["trace", "generate", "--workload", "coding", "--batch", "3", "--seed", "5"]
    expected = generate(GenerateConfig(workload="coding", batch=3, seed=5))
    for extra in ([], ["--out", "-"]):
        assert cli.main([*argv, *extra]) == 0
        assert capsys.readouterr() == (expected, "")
    out = tmp_path / "t.jsonl"
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert capsys.readouterr() == ("", "")
    assert out.read_text() == expected


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_simulate_reads_stdin_and_writes_json_to_stdout(
    trace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, trace.read_bytes())
    assert cli.main(["simulate", "--trace", "-", "--policy", "tangram,static"]) == 0
    table = capsys.readouterr()
    assert table.out.startswith("coding-6: 6 trajectories, 18 actions, capacity cpu=6\n")
    assert table.err == ""
    _stdin(monkeypatch, trace.read_bytes())
    assert cli.main(["simulate", "--trace", "-", "--policy", "tangram,static", "--json", "-"]) == 0
    captured = capsys.readouterr()
    # The JSON alone on stdout, so `| jq` works; the table moves to stderr.
    document = json.loads(captured.out)
    assert set(document["policies"]) == {"tangram", "static"}
    assert captured.err == table.out


def test_simulate_plot_format_follows_the_extension(
    trace: Path, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    pytest.importorskip("matplotlib")
    magic = {"png": b"\x89PNG\r\n\x1a\n", "svg": b"<?xml", "pdf": b"%PDF-"}
    for suffix, start in magic.items():
        path = tmp_path / f"acts.{suffix.upper() if suffix == 'pdf' else suffix}"
        assert cli.main(["simulate", "--trace", str(trace), "--plot", str(path)]) == 0
        assert path.read_bytes().startswith(start), suffix
    svg = (tmp_path / "acts.svg").read_bytes()
    assert b"<svg" in svg
    assert cli.main(["simulate", "--trace", str(trace), "--plot", str(tmp_path / "b.svg")]) == 0
    assert (tmp_path / "b.svg").read_bytes() == svg  # no date, fixed ids
    capsysbinary.readouterr()
    assert cli.main(["simulate", "--trace", str(trace), "--plot", "-"]) == 0
    captured = capsysbinary.readouterr()
    assert captured.out.startswith(magic["png"])
    assert captured.err.startswith(b"coding-6: ")


@pytest.mark.parametrize("name", ["acts.gif", "acts", "acts.png.txt"])
def test_simulate_plot_with_an_unknown_format_is_a_usage_error(
    name: str, trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    assert _exit_code(["simulate", "--trace", str(trace), "--plot", str(path)]) == 2
    assert "end it in .png, .svg, .pdf" in capsys.readouterr().err
    assert not path.exists()


def test_json_and_plot_cannot_both_be_stdout(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(["simulate", "--trace", str(trace), "--json", "-", "--plot", "-"]) == 2
    assert "cannot both be -" in capsys.readouterr().err


def test_header_only_trace_is_an_input_error_without_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(HEADER)
    out = tmp_path / "r.json"
    assert cli.main(["simulate", "--trace", str(path), "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"TraceFormatError: the trace has no actions: nothing to simulate (in {path})\n"
    )
    assert not out.exists()
    _stdin(monkeypatch, HEADER.encode())
    assert cli.main(["simulate", "--trace", "-"]) == 2
    assert "nan" not in capsys.readouterr().err.lower()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (HEADER.encode() + b"\xff\xfe binary\n", "line 2: not UTF-8 text"),
        (HEADER.encode() + b'{"a": ' + b"[" * 50_000 + b"\n", "line 2: not JSON"),
        (b"", "the trace is empty"),
    ],
)
def test_malformed_traces_exit_2_naming_file_and_line(
    content: bytes, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    assert cli.main(["simulate", "--trace", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"TraceFormatError: {reason}")
    assert captured.err.endswith(f"(in {path})\n")


def test_unreadable_trace_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(["simulate", "--trace", str(tmp_path / "absent.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert _exit_code(["simulate", "--trace", str(tmp_path)]) == 2


# -- doctor and serve-sandbox-fusion ------------------------------------------------------


def test_doctor_json_is_one_document_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--json"]) == 0
    captured = capsys.readouterr()
    facts = json.loads(captured.out)
    assert facts["cores"]["usable"] >= 1
    assert {"docker", "local sandbox", "gpus", "torch", "bench"} <= set(facts)
    assert captured.err == ""


def test_serve_sandbox_fusion_config_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(["serve-sandbox-fusion", "--config", str(tmp_path / "no.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert _exit_code(["serve-sandbox-fusion", "--config", "-"]) == 2
    assert "is read by path" in capsys.readouterr().err
    config = tmp_path / "tangram.toml"
    config.write_text("[runtime]\n")
    assert cli.main(["serve-sandbox-fusion", "--config", str(config), "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("ConfigError: ")
    assert captured.out == ""


# -- a reader that goes away -----------------------------------------------------------------


def test_a_closed_pipe_ends_quietly() -> None:
    """``tangram trace generate ... | head``: no BrokenPipeError traceback, exit 1.

    A real pipe to a real ``head``: only a separate process shows what the interpreter
    prints when stdout's reader has gone.
    """
    argv = [sys.executable, "-m", "tangram._tools._cli", "trace", "generate"]
    argv += ["--workload", "coding", "--batch", "20000"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as tangram_:
        assert tangram_.stdout is not None
        head = subprocess.run(
            ["head", "-n", "2"], stdin=tangram_.stdout, capture_output=True, check=True
        )
        tangram_.stdout.close()
        _, err = tangram_.communicate(timeout=120)
    assert head.stdout.count(b"\n") == 2
    assert head.stdout.startswith(b'{"capacity"')
    assert err == b""
    assert tangram_.returncode == 1


# -- bench: --check and where progress goes -------------------------------------------------


@pytest.mark.parametrize(("met", "code"), [(True, 0), (False, 1)])
def test_bench_check_exits_1_when_a_target_is_missed(
    met: bool, code: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run itself is replaced (tests/test_bench.py runs it for real); the verdict is not."""
    import tangram._tools._bench as bench
    import tangram._tools._bench_report as bench_report

    def run(config: object, hook: object) -> str:
        return "result"

    targets = {"avg_act": {"value": 1.5 if met else 0.9, "goal": ">= 1", "met": met}}
    monkeypatch.setattr(bench, "run_bench", run)
    monkeypatch.setattr(bench_report, "bench_table", lambda result: "the table")
    monkeypatch.setattr(bench_report, "report", lambda result: {"targets": targets})
    assert cli.main(["bench", "--trajectories", "1", "--turns", "1"]) == 0
    assert capsys.readouterr() == ("the table\n", "")
    assert cli.main(["bench", "--trajectories", "1", "--turns", "1", "--check"]) == code
    captured = capsys.readouterr()
    assert captured.out == "the table\n"
    assert captured.err == ("" if met else "targets not met: avg_act 0.90 (goal >= 1)\n")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bench_progress_defaults_to_stderr_live_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tangram._tools._bench import MeasuredAction
    from tangram._tools._bench_report import live_progress

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with live_progress(1) as hook:
        hook("tangram", None)
        hook("tangram", MeasuredAction("t0", 0, "tests", 0.5, 0.1, 0.0, 0.4, 2, 2, "ok"))
    assert "t0 tests: ACT 0.50 s on 2 cores" in terminal.getvalue()  # rich's live display
    assert capsys.readouterr().out == ""
