"""The code reward: a dataset's tests, judged in a sandbox by a harness the answer cannot forge.

Under RL the answer is written by a policy optimised against this reward, so the verdict
must not be anything the answer controls. Running ``answer + tests`` in one process and
reading its exit status (what the adapters did before, and what most code-RL recipes do)
scores 1.0 for ``os._exit(0)``, an ``atexit`` hook, a forged ``__eq__`` or a patched
builtin. Here :func:`grade` sends the trusted harness (:mod:`._harness` with
:mod:`._checks`, compiled: :func:`_program`) into the sandbox with a per-call secret and
the tests on its stdin; the harness runs the answer in a separate process, runs the tests itself
and prints the one line that counts, carrying the secret. See ``docs/rewards.md`` for what
this guarantees and what it does not.

Two kinds of tests, the two that code-RL datasets carry:

- assertion tests: MBPP's ``assert f(x) == y`` lines, HumanEval's ``def check(candidate)``
  with an entry point, verl's ``assert_case``;
- input/output tests: ``{"inputs": [...], "outputs": [...]}`` (APPS, TACO, CodeContests,
  verl's SandboxFusion format), compared as SandboxFusion compares standard output, or,
  with ``fn_name``, as calls of that function (or of that method of ``Solution``).
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import marshal
import secrets
from collections.abc import Mapping
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from typing import Any

import attrs

from .._core._demand import Elastic
from .._core._validate import seconds
from .._sandbox._pool import Sandbox, utf8
from ..errors import InvalidSettingError, SandboxBrokenError, SettingTypeError
from ._in_sandbox import _calls, _checks, _fork, _harness, _kept, _raised, _wire

__all__ = [
    "DEFAULT_CASE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "TestSuite",
    "Verdict",
    "grade",
    "parse_tests",
]

DEFAULT_TIMEOUT = 60.0
"""Seconds one answer's whole grading may take (interpreter start, every test)."""
DEFAULT_CASE_TIMEOUT = 10.0
"""Seconds one call into the answer (or one input/output case) may take."""

_log = logging.getLogger("tangram.reward")

# The harness needs a moment of the budget for itself: start-up before the first test
# and the verdict after the last.
_HARNESS_MARGIN = 2.0


@functools.cache
def _harness_source() -> str:
    """The program the sandbox runs: the harness, then the modules it imports (which it
    does not import there: it is no package), then the call of its ``main``."""
    paths = (
        _harness.__file__,
        _calls.__file__,
        _raised.__file__,
        _checks.__file__,
        _wire.__file__,
        _kept.__file__,
        _fork.__file__,
    )
    parts = [Path(path).read_text(encoding="utf-8") for path in paths]
    return "\n".join([*parts, "main()\n"])


#: What the sandbox's interpreter runs (``python -I -c``): it reads the harness from its
#: stdin, and runs this process's bytecode of it where its bytecode is the same as ours
#: (the magic number, which every change of bytecode changes, as for ``.pyc`` files), or
#: else compiles the source sent with it. Compiling the harness (some 1,900 lines) took a
#: third of an answer's grading. Read with ``os.read``, exactly its bytes: a buffered read
#: would read on into the secret and the tests, and the answer's processes, forked from
#: this one, would hold them (the harness seals itself before it reads them).
_BOOT = """\
import os as _o, marshal as _m, _frozen_importlib_external as _e
def _r(n):
    b = b""
    while len(b) < n:
        c = _o.read(0, n - len(b))
        if not c:
            raise EOFError("the harness was cut short")
        b += c
    return b
def _b():
    m, c, s = _r(%d).split()
    c, s = _r(int(c)), _r(int(s))
    return _m.loads(c) if m == _e.MAGIC_NUMBER.hex().encode() else compile(s, "<harness>", "exec")
exec(_b())
"""
_HEAD = len(f"{MAGIC_NUMBER.hex()} {0:010d} {0:010d}\n")


@functools.lru_cache(maxsize=2)
def _program(source: str) -> bytes:
    """What ``_BOOT`` reads before the harness's own stdin: a fixed-width head (magic
    number, lengths), this interpreter's bytecode of ``source``, and ``source``."""
    code = marshal.dumps(compile(source, "<harness>", "exec", dont_inherit=True, optimize=0))
    text = source.encode("utf-8")
    head = f"{MAGIC_NUMBER.hex()} {len(code):010d} {len(text):010d}\n".encode()
    assert len(head) == _HEAD
    return head + code + text


@attrs.frozen
class TestSuite:
    """A label in the one form the harness reads; build it with :func:`parse_tests`.

    ``spec`` is what the harness receives; ``total`` is how many tests it holds.
    """

    __test__ = False  # not a pytest test class, whatever its name says

    spec: Mapping[str, Any]
    total: int


@attrs.frozen
class Verdict:
    """How one answer did: ``passed`` of ``total`` tests.

    ``judged`` is false when the harness gave no verdict because something in the
    sandbox ended or stopped it (only the answer runs there beside it): that scores 0.
    """

    passed: int
    total: int
    judged: bool = True

    @property
    def all_passed(self) -> bool:
        return self.judged and self.total > 0 and self.passed == self.total

    def score(self, *, partial: bool = False) -> float:
        """1.0 when every test passed, else 0.0; with ``partial``, the fraction passed."""
        if partial:
            return self.passed / self.total if self.judged and self.total else 0.0
        return 1.0 if self.all_passed else 0.0


# -- labels ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A column as datasets hand it over (numpy arrays from parquet) as Python lists."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


def _text(value: Any, where: str) -> str:
    value = _plain(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise InvalidSettingError(f"{where} must be a string or a list of lines (got {value!r:.80})")


def _arguments(value: Any) -> list[Any]:
    """A call test's input: a list of arguments, or one JSON value per line (verl's form)."""
    value = _plain(value)
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        try:
            return [json.loads(line) for line in value.split("\n") if line.strip()]
        except ValueError as exc:
            raise InvalidSettingError(f"a call test's input is not JSON lines ({exc})") from None
    return [value]


def _asserts(source: str, entry_point: str | None) -> TestSuite:
    try:
        total = _checks.count_tests(
            {"kind": "assert", "source": source, "entry_point": entry_point}
        )
    except SyntaxError as exc:
        raise InvalidSettingError(f"the tests do not parse: {exc}") from None
    if total == 0:
        raise InvalidSettingError(
            "the tests hold no test: no top-level `assert` or call, and no `check` with an "
            "`entry_point`"
        )
    return TestSuite({"kind": "assert", "source": source, "entry_point": entry_point}, total)


def _from_mapping(label: Mapping[str, Any]) -> TestSuite:
    if "inputs" in label and "outputs" in label and not _plain(label.get("assert_case")):
        inputs, outputs = _plain(label["inputs"]), _plain(label["outputs"])
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise InvalidSettingError("`inputs` and `outputs` must be lists")
        if len(inputs) != len(outputs) or not inputs:
            raise InvalidSettingError(
                f"`inputs` and `outputs` must be non-empty and as long as each other "
                f"(got {len(inputs)} and {len(outputs)})"
            )
        fn_name = label.get("fn_name")
        if fn_name:
            if not isinstance(fn_name, str) or not fn_name.isidentifier():
                raise InvalidSettingError(f"`fn_name` must be a Python name (got {fn_name!r})")
            cases = [
                {"args": _arguments(i), "expected": _plain(o)}
                for i, o in zip(inputs, outputs, strict=True)
            ]
            try:
                json.dumps(cases)
            except (TypeError, ValueError) as exc:
                raise InvalidSettingError(f"call tests must be JSON values ({exc})") from None
            return TestSuite({"kind": "call", "fn_name": fn_name, "cases": cases}, len(cases))
        stdio = [
            {"stdin": _text(i, "an input"), "stdout": _text(o, "an output")}
            for i, o in zip(inputs, outputs, strict=True)
        ]
        return TestSuite({"kind": "stdio", "cases": stdio}, len(stdio))
    for key in ("assert_case", "test_list"):
        if key in label:
            lines = _plain(label[key])
            if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
                raise InvalidSettingError(f"`{key}` must be a list of strings")
            setup = [
                _text(label[k], f"`{k}`")
                for k in ("test_imports", "test_setup_code")
                if label.get(k)
            ]
            return _asserts("\n".join([*setup, *lines]) + "\n", None)
    if "test" in label:
        entry_point = label.get("entry_point")
        if entry_point is not None and (
            not isinstance(entry_point, str) or not entry_point.isidentifier()
        ):
            raise InvalidSettingError(f"`entry_point` must be a Python name (got {entry_point!r})")
        suite = _asserts(_text(label["test"], "`test`"), entry_point)
        prompt = _plain(label.get("prompt"))
        if prompt is None:
            return suite
        if not isinstance(prompt, str):
            raise InvalidSettingError(f"`prompt` must be Python source (got {prompt!r:.80})")
        try:
            ast.parse(prompt)
        except SyntaxError as exc:
            raise InvalidSettingError(f"the prompt does not parse: {exc}") from None
        return TestSuite({**suite.spec, "helpers": prompt}, suite.total)
    raise InvalidSettingError(
        "a test mapping needs `inputs` and `outputs` (with `fn_name` for calls), "
        f"`assert_case`, `test_list` or `test` (got keys {sorted(label)})"
    )


def _checked(suite: TestSuite) -> TestSuite:
    """``suite``, once it is known to travel: text the harness can read (UTF-8)."""
    try:
        json.dumps(dict(suite.spec), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidSettingError(f"the tests hold text that is not UTF-8 ({exc})") from None
    return suite


def parse_tests(label: object) -> TestSuite:
    """A dataset's label as a :class:`TestSuite`.

    - a string: assertion tests (Python source), or a JSON object read as below;
    - a list of strings: assertion lines (MBPP's ``test_list``);
    - a mapping: ``inputs``/``outputs`` (+ ``fn_name``) as input/output or call tests;
      ``assert_case`` or ``test_list`` (+ ``test_imports``, ``test_setup_code``); or
      ``test`` (+ ``entry_point``, and ``prompt`` whose definitions but the entry
      point's are the tests', HumanEval's form).

    :raises InvalidSettingError: the label holds no test that can be run (a ValueError).
    :raises SettingTypeError: the label is none of these (a TypeError).
    """
    if isinstance(label, TestSuite):
        return label
    return _checked(_parse(label))


def _parse(label: object) -> TestSuite:
    label = _plain(label)
    if isinstance(label, str):
        stripped = label.strip()
        if stripped.startswith("{"):
            try:
                decoded = json.loads(stripped)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                return _from_mapping(decoded)
        return _asserts(label, None)
    if isinstance(label, list) and all(isinstance(line, str) for line in label):
        return _asserts("\n".join(label) + "\n", None)
    if isinstance(label, Mapping):
        return _from_mapping(label)
    raise SettingTypeError(
        f"tests must be a string, a list of strings or a mapping (got {label!r:.80})"
    )


# -- grading -----------------------------------------------------------------------------


def _interpreter(sandbox: Sandbox) -> str:
    # The interpreter ``sbx.run(code=...)`` uses; ``-I`` is added to it, so ``code=`` (no
    # way to pass flags) cannot be used. A local and a remote sandbox both name it.
    return sandbox.python


def _seconds(name: str, value: float | None, default: float) -> float:
    return default if value is None else seconds(name, value, strict=True)


def _messages(stdout: bytes, secret: str) -> list[Any]:
    """The harness's lines: those that start with the secret (nothing else can write them)."""
    prefix = secret.encode() + b" "
    found = []
    for line in stdout.split(b"\n"):
        if line.startswith(prefix):
            try:
                found.append(json.loads(line[len(prefix) :]))
            except ValueError as exc:
                raise SandboxBrokenError(f"the grading harness wrote a bad line ({exc})") from exc
    return found


async def grade(
    sandbox: Sandbox,
    answer: str,
    tests: object,
    *,
    cpu: int | float | Elastic = 1,
    timeout: float | None = None,
    case_timeout: float | None = None,
    kind: str = "reward",
) -> Verdict:
    """Judge ``answer`` (Python source) against ``tests`` (see :func:`parse_tests`).

    Use a sandbox no model-written code has run in before (a fresh one from the pool): a
    file or process left there by earlier code is not part of what the harness defends.
    ``timeout`` bounds the whole grading, ``case_timeout`` each call into the answer and
    each input/output case; a test past either fails.

    :raises InvalidSettingError: the tests hold nothing to run, or a timeout is not > 0.
    :raises SettingTypeError: ``answer`` is not a string, or the tests none of the forms.
    :raises SandboxBrokenError: the sandbox or the harness failed before the answer ran
        (or the harness misbehaved): tangram's failure, never scored as the answer's.
    """
    if not isinstance(answer, str):
        raise SettingTypeError(f"`answer` must be Python source (got {answer!r:.80})")
    suite = parse_tests(tests)
    try:
        utf8("`answer`", answer)
    except InvalidSettingError:
        # A lone surrogate (text decoded with ``surrogateescape``) cannot reach the
        # harness as source: the answer's text, so its 0, never the step's failure.
        return Verdict(0, suite.total)
    whole_run = _seconds("timeout", timeout, DEFAULT_TIMEOUT)
    budget = whole_run - min(_HARNESS_MARGIN, whole_run / 5)
    per_case = min(_seconds("case_timeout", case_timeout, DEFAULT_CASE_TIMEOUT), budget)
    secret = secrets.token_hex(16)
    program = _program(_harness_source())
    payload = {
        "answer": answer,
        "tests": dict(suite.spec),
        "budget": budget,
        "case_timeout": per_case,
    }
    result = await sandbox.run(
        [_interpreter(sandbox), "-I", "-c", _BOOT % _HEAD],
        stdin=program + f"{secret}\n{json.dumps(payload)}".encode(),
        cpu=cpu,
        timeout=whole_run,
        kind=kind,
    )
    messages = _messages(result.stdout, secret)
    if not messages or messages[0] != {"started": True}:
        why = messages[0].get("error") if messages and isinstance(messages[0], dict) else None
        detail = why or result.stderr.decode(errors="replace")[-2000:]
        raise SandboxBrokenError(
            f"the grading harness did not start (exit {result.exit_code}): {detail}"
        )
    if len(messages) == 1:
        return Verdict(0, suite.total, judged=False)  # ended or stopped mid-way
    final = messages[1]
    if len(messages) > 2 or not isinstance(final, dict) or "error" in final:
        raise SandboxBrokenError(f"the grading harness failed: {final!r:.2000}")
    passed, total = final.get("passed"), final.get("total")
    if type(passed) is not int or total != suite.total or not 0 <= passed <= suite.total:
        raise SandboxBrokenError(f"the grading harness gave a bad verdict: {final!r:.200}")
    if "fault" in final:
        # The answer may lower the harness's limits, so a failure after it ran is scored
        # as the answer's; kept in the log in case it was tangram's own.
        _log.info("the grading harness failed after the answer ran: %.100s", final["fault"])
    return Verdict(passed, suite.total)
