"""The ``tangram`` command, run in-process as a user would call it."""

from __future__ import annotations

import argparse

import pytest

import tangram._tools._cli as cli
from tangram.errors import InvalidDemandError


def test_tangram_errors_print_type_and_message_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise InvalidDemandError("`max` must be >= `min` (got 2 < 4)")

    monkeypatch.setattr(cli, "_bench", broken)
    assert cli.main(["bench"]) == 1
    assert capsys.readouterr().err.strip() == (
        "InvalidDemandError: `max` must be >= `min` (got 2 < 4)"
    )


@pytest.mark.parametrize(
    "bad", [["bench", "--cores", "0"], ["bench", "--time-scale", "-1"], ["demo"], []]
)
def test_bad_arguments_exit_with_usage(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(bad)
    assert info.value.code == 2
