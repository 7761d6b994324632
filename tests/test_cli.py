"""The ``tangram`` command, run in-process as a user would call it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tangram._tools._cli as cli
from tangram.errors import InvalidDemandError


def test_demo_prints_both_arms_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo.json"
    argv = ["demo", "--trajectories", "4", "--turns", "2", "--cores", "4", "--time-scale", "0.05"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("tangram demo: 4 trajectories x 2 turns on 4 cores")
    assert lines[2].split()[0] == "tangram"
    assert lines[3].split()[0] == "static"
    assert lines[4].startswith("static / tangram: avg_act ")
    figures = json.loads(out.read_text())
    for arm in ("tangram", "static"):
        assert figures[arm]["actions"] == 8
        assert figures[arm]["avg_act"] > 0
        assert figures[arm]["core_seconds"] > 0
    assert figures["ratios"]["avg_act"] == pytest.approx(
        figures["static"]["avg_act"] / figures["tangram"]["avg_act"]
    )


def test_tangram_errors_print_type_and_message_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(config: object) -> object:
        raise InvalidDemandError("`max` must be >= `min` (got 2 < 4)")

    monkeypatch.setattr(cli, "run_demo", broken)
    assert cli.main(["demo"]) == 1
    assert capsys.readouterr().err.strip() == (
        "InvalidDemandError: `max` must be >= `min` (got 2 < 4)"
    )


@pytest.mark.parametrize("bad", [["demo", "--cores", "0"], ["demo", "--time-scale", "-1"], []])
def test_bad_arguments_exit_with_usage(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(bad)
    assert info.value.code == 2
