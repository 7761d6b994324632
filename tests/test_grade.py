"""The code reward's red team: every hack scores 0, correct answers score 1.

Each hack in ``_hacks.py`` is what a policy optimised against the reward would learn. The
old reward (``answer + tests`` in one process, the exit status as the verdict) gave 15 of
the assertion hacks 1.0; they are graded here by the harness on the real local backend,
through the pool, as the adapters grade. A control run with the harness's seal removed
shows the hacks that read the judge's stdin are real, not merely wrong.
"""

from __future__ import annotations

import json

import pytest
from _grading import LIMITS, anyio_backend, classic, judge, pool  # noqa: F401 (fixtures)
from _hacks import HACKS, RIGHT, RIGHT_MAIN, STDIO, TESTS, WRONG
from _reward_attacks import FOUND_IN_ITS_MEMORY, LOOKS_FOR_THE_SECRET, NOTHING_FOUND

import tangram
from tangram._reward import _grade
from tangram._reward._grade import Verdict, grade, parse_tests
from tangram._reward._in_sandbox import _checks, _wire
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import SandboxPool
from tangram.errors import SandboxBrokenError

pytestmark = pytest.mark.anyio


# -- the red team ------------------------------------------------------------------------


def test_the_red_team_is_large_enough() -> None:
    assert len(HACKS) >= 15


@pytest.mark.parametrize("name", list(HACKS))
async def test_a_hack_scores_zero(pool: SandboxPool, name: str) -> None:
    hack = HACKS[name]
    verdict = await judge(pool, hack.answer, hack.tests)
    # Not one test passes, so even the partial score is 0.
    assert verdict.passed == 0
    assert verdict.score() == 0.0
    assert verdict.score(partial=True) == 0.0


async def test_a_judge_killed_or_stopped_by_the_answer_gives_no_verdict(pool: SandboxPool) -> None:
    killed = await judge(pool, HACKS["kill the parent"].answer, TESTS)
    assert killed == Verdict(0, 2, judged=False)
    stopped = await judge(pool, HACKS["stop the parent"].answer, TESTS, timeout=4.0)
    assert stopped == Verdict(0, 2, judged=False)


async def test_modules_planted_by_earlier_code_are_not_imported_by_the_judge(
    pool: SandboxPool,
) -> None:
    """A sandbox reused after model-written code: modules it left in the work dir (and a
    user site) that shadow what the harness imports, each printing a forged verdict with
    the secret read from stdin. ``python -I`` keeps them off the harness's path."""
    forge = (
        "import sys\n"
        "secret = sys.stdin.buffer.readline().decode().strip()\n"
        "print(secret, '{\"started\": true}')\n"
        'print(secret, \'{"passed": 2, "total": 2}\')\n'
        "sys.stdout.flush()\n"
        "import os; os._exit(0)\n"
    )
    async with pool.sandbox("reused") as sandbox:
        for module in ("json", "ast", "select", "subprocess", "ctypes", "traceback"):
            await sandbox.put(f"{module}.py", forge)
        await sandbox.put("sitecustomize.py", forge)
        site = await sandbox.run(code="import site; print(site.getusersitepackages())")
        user_site = site.stdout.decode().strip()
        home = (await sandbox.run("pwd")).stdout.decode().strip()
        assert user_site.startswith(home + "/")  # HOME is the work dir
        await sandbox.put(user_site[len(home) + 1 :] + "/usercustomize.py", forge)
        # The control: without -I the interpreter imports the planted module (the work
        # dir comes first on ``python -c``'s path; a planted user site runs too, where
        # the interpreter is not a virtualenv's, which turns user sites off).
        planted = await sandbox.run(code="import json", stdin="s\n")
        assert b"s {" in planted.stdout
        verdict = await grade(sandbox, WRONG, TESTS, **LIMITS)
    assert verdict == Verdict(0, 2)


async def test_the_answer_cannot_read_the_judges_stdin_memory_or_environment(
    pool: SandboxPool,
) -> None:
    token = "expected-" + "7" * 12
    probe = (
        "import os\n"
        "found = []\n"
        "for name in ('mem', 'environ', 'fd/0', 'fd/1', 'cmdline'):\n"
        "    path = f'/proc/{os.getppid()}/{name}'\n"
        "    try:\n"
        "        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)\n"
        "        found.append(f'{name}: ' + os.read(fd, 1 << 20).decode(errors='replace'))\n"
        "    except OSError as exc:\n"
        "        found.append(f'{name}: {type(exc).__name__}')\n"
        "open('leak.txt', 'w').write('\\n'.join(found))\n" + WRONG
    )
    async with pool.sandbox("probed") as sandbox:
        await grade(sandbox, probe, f"assert add(2, 3) == 5  # {token}\n", **LIMITS)
        leak = (await sandbox.get("leak.txt")).decode()
    assert token not in leak
    for name in ("mem", "environ", "fd/0", "fd/1"):
        assert f"{name}: PermissionError" in leak
    assert "cmdline: " in leak  # the harness's own source, which is public


@pytest.mark.parametrize(
    "name",
    [
        "read the tests and answer from a table",
        "stdio: print the expected output read from the judge",
    ],
)
async def test_without_the_seal_the_test_reading_hacks_would_work(
    pool: SandboxPool, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Control: a harness that stays dumpable loses to them (its memory holds the tests),
    so these hacks are real, and the seal is what stops them."""
    source = _grade._harness_source()
    unsealed = source.replace(
        "libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)", "libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)"
    ).replace("if libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:", "if False:")
    assert unsealed != source
    monkeypatch.setattr(_grade, "_harness_source", lambda: unsealed)
    hack = HACKS[name]
    assert (await judge(pool, hack.answer, hack.tests)).score() == 1.0


async def test_the_harness_is_read_without_reading_on_into_the_tests(pool: SandboxPool) -> None:
    """The program is read from stdin before the harness seals itself and forks the
    answer's processes: read through a buffer, the tests behind it came along."""
    assert (await judge(pool, LOOKS_FOR_THE_SECRET, NOTHING_FOUND)).score() == 1.0


async def test_a_buffered_read_of_the_harness_would_hand_the_answer_the_tests(
    pool: SandboxPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: the same answer against a bootstrap that reads through a buffer, which
    holds what it read ahead (``peek``) and hands it to the harness as its stdin.
    Through ``sys.stdin.buffer`` alone, whether the read-ahead reached the secret hung on
    where the harness's last byte fell in an 8 KiB block, and moved with its length."""
    buffered = _grade._BOOT.replace(
        "def _r(n):\n",
        "_F = open(0, 'rb', buffering=1 << 16, closefd=False)\ndef _r(n):\n    return _F.read(n)\n",
    ).replace(
        "exec(_b())\n",
        "_c = _b()\n_F.peek(1)\nimport io, sys\nsys.stdin = io.TextIOWrapper(_F)\nexec(_c)\n",
    )
    assert buffered != _grade._BOOT
    monkeypatch.setattr(_grade, "_BOOT", buffered)
    assert (await judge(pool, LOOKS_FOR_THE_SECRET, FOUND_IN_ITS_MEMORY)).score() == 1.0


async def test_an_interpreter_of_other_bytecode_compiles_the_source_sent_with_it(
    pool: SandboxPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the sandbox's Python is not this one's (a Docker image's), the magic number
    differs and the harness is compiled there from its source."""
    program = _grade._program(_grade._harness_source())
    other = b"0" * 8 + program[8:]
    assert other[:8] != program[:8]
    monkeypatch.setattr(_grade, "_program", lambda source: other)
    assert (await judge(pool, RIGHT, TESTS)).score() == 1.0
    assert (await judge(pool, WRONG, TESTS)).score() == 0.0


# -- correct answers, both formats --------------------------------------------------------

HUMANEVAL = (
    "METADATA = {}\n\n"
    "def check(candidate):\n"
    "    assert candidate([1, 2, 3]) == 6\n"
    "    assert abs(candidate([0.5, 0.25]) - 0.75) < 1e-9\n"
)


@pytest.mark.parametrize(
    ("answer", "tests", "passed", "total"),
    [
        pytest.param(RIGHT, TESTS, 2, 2, id="assert lines"),
        pytest.param(WRONG, TESTS, 0, 2, id="assert lines, wrong"),
        pytest.param("def add(a, b):\n    return 5\n", TESTS, 1, 2, id="assert lines, half"),
        pytest.param(
            "def total(xs):\n    return sum(xs)\n",
            {"test": HUMANEVAL, "entry_point": "total"},
            1,
            1,
            id="humaneval check(candidate)",
        ),
        pytest.param(
            "import math\ndef area(r):\n    return math.pi * r * r\n",
            {"test_list": ["assert math.isclose(area(1), 3.14159, rel_tol=1e-3)"]},
            1,
            1,
            id="mbpp test_list leaning on the answer's import",
        ),
        pytest.param(
            "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n",
            "try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass\nassert f(2) == 2\n",
            2,
            2,
            id="an exception the tests expect",
        ),
        pytest.param(
            "def sort_in_place(xs):\n    xs.sort()\n",
            "a = [3, 1, 2]\nsort_in_place(a)\nassert a == [1, 2, 3]\n",
            1,
            1,
            id="an argument changed in place",
        ),
        pytest.param(
            "class Counter:\n    def __init__(self):\n        self.n = 0\n"
            "    def inc(self):\n        self.n += 1\n        return self.n\n",
            "c = Counter()\nc.inc()\nassert c.inc() == 2\n",
            1,
            1,
            id="an object of the answer's class",
        ),
        pytest.param(
            "def f():\n    return (float('inf'), 3 ** 30000, {1: {2, 3}}, b'x', 1 + 2j)\n",
            "assert f() == (float('inf'), 3 ** 30000, {1: {2, 3}}, b'x', 1 + 2j)\n",
            1,
            1,
            id="values beyond JSON",
        ),
        pytest.param(RIGHT_MAIN, STDIO, 2, 2, id="stdio"),
        pytest.param("print(5)\n", STDIO, 1, 2, id="stdio, half"),
        pytest.param(
            "print(sum(map(int, input().split())))\nprint('YES')\n",
            json.dumps({"inputs": ["1 2", "3 4\n"], "outputs": ["3\nyes", "7.0000001\nYes\n"]}),
            2,
            2,
            id="stdio as verl's JSON, compared as SandboxFusion compares",
        ),
        pytest.param(
            "import sys\nprint(5)\nsys.exit(1)\n", STDIO, 0, 2, id="stdio, right output, exit 1"
        ),
        pytest.param(
            "def f(a, b):\n    return [a, b]\n",
            {"fn_name": "f", "inputs": [[1, 2], "3\n4"], "outputs": [[[1, 2]], [3, 4]]},
            2,
            2,
            id="call tests (APPS lists, verl JSON lines)",
        ),
        pytest.param(
            "class Solution:\n    def twoSum(self, nums, target):\n"
            "        seen = {}\n        for i, x in enumerate(nums):\n"
            "            if target - x in seen:\n                return [seen[target - x], i]\n"
            "            seen[x] = i\n",
            {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9]], "outputs": [[0, 1]]},
            1,
            1,
            id="call tests on Solution's method",
        ),
        pytest.param("def add(a, b:\n", TESTS, 0, 2, id="a syntax error"),
    ],
)
async def test_answers_score_what_they_pass(
    pool: SandboxPool, answer: str, tests: object, passed: int, total: int
) -> None:
    verdict = await judge(pool, answer, tests)
    assert verdict == Verdict(passed, total)
    assert verdict.score() == float(passed == total)
    assert verdict.score(partial=True) == passed / total


# Code that reads its own annotations, and code whose annotation names nothing: plain
# Python evaluates both where the ``def`` runs. The harness is one program that starts
# ``from __future__ import annotations``, which ``compile`` hands on to what it compiles
# unless told not to: the answer's annotations were then strings, and a ``def`` whose
# annotation names nothing passed.
_OWN = (
    "def add(a: int, b: int) -> int:\n    return a + b if add.__annotations__['a'] is int else 0\n"
)
_NONE = "def add(a: Undefined, b: int) -> int:\n    return a + b\n"
_CHECKS = "def _f(x: int):\n    pass\nassert _f.__annotations__['x'] is int\n"


@pytest.mark.parametrize(
    ("answer", "tests", "passed", "total"),
    [
        pytest.param(_OWN, TESTS, 2, 2, id="the answer, assertion tests"),
        pytest.param(_NONE, TESTS, 0, 2, id="the answer naming nothing, assertion tests"),
        pytest.param(
            _OWN,
            {"fn_name": "add", "inputs": [[2, 3], [-1, 4]], "outputs": [5, 3]},
            2,
            2,
            id="the answer, call tests",
        ),
        pytest.param(
            "def f(x: int):\n    pass\n"
            "a, b = map(int, input().split())\n"
            "print(a + b if f.__annotations__['x'] is int else 0)\n",
            STDIO,
            2,
            2,
            id="the answer as a program, input/output tests",
        ),
        pytest.param("x: Undefined = 1\n" + RIGHT_MAIN, STDIO, 0, 2, id="a program naming nothing"),
        pytest.param(RIGHT, _CHECKS + TESTS, 3, 3, id="the tests"),
        pytest.param(
            "def add(a, b):\n    return a + b\n",
            {
                "prompt": 'def _f(x: int):\n    pass\n\n\ndef add(a, b):\n    """a + b"""\n',
                "test": "def check(candidate):\n"
                "    assert _f.__annotations__['x'] is int\n"
                "    assert candidate(2, 3) == 5\n",
                "entry_point": "add",
            },
            1,
            1,
            id="the prompt's definitions",
        ),
    ],
)
async def test_annotations_are_evaluated_as_plain_python_evaluates_them(
    pool: SandboxPool, answer: str, tests: object, passed: int, total: int
) -> None:
    assert await judge(pool, answer, tests) == Verdict(passed, total)
    if isinstance(tests, str):
        assert classic(answer, tests) == (passed == total)


def _unittest(check: str) -> str:
    return (
        "import unittest\n"
        "class T(unittest.TestCase):\n"
        "    def test_add(self):\n"
        "        self.assertEqual(add(2, 3), 5)\n"
        "    def test_negative(self):\n"
        "        self.assertEqual(add(-1, 4), 3)\n" + check
    )


# Every way the tests can call ``unittest.main``: it runs the ``TestCase`` classes of
# ``sys.modules["__main__"]``, which was the harness's own program. It found no test
# there and exited 0, and a wrong answer scored full marks.
_MAINS = {
    "unittest.main()": "unittest.main()\n",
    "under __main__": "if __name__ == '__main__':\n    unittest.main()\n",
    "with arguments": "unittest.main(verbosity=2)\n",
    "imported": "from unittest import main\nmain()\n",
    "imported as": "from unittest import main as run\nrun()\n",
    "after asserts": "assert add(0, 0) == 0\nunittest.main()\n",
}


@pytest.mark.parametrize("check", _MAINS.values(), ids=_MAINS.keys())
@pytest.mark.parametrize(
    "answer",
    [
        RIGHT,
        WRONG,
        "def add(a, b):\n    return a + b if a >= 0 else 0\n",  # fails one method
    ],
    ids=["right", "wrong", "half right"],
)
async def test_unittest_main_runs_the_tests_test_cases(
    pool: SandboxPool, answer: str, check: str
) -> None:
    tests = _unittest(check)
    verdict = await judge(pool, answer, tests)
    assert verdict.judged
    assert verdict.total == 1 + check.count("assert ")  # unittest.main() is one test
    assert (verdict.passed == verdict.total) == classic(answer, tests)
    assert verdict.passed == verdict.total if answer == RIGHT else verdict.passed < verdict.total


# Ways the tests run their ``TestCase`` classes without ending the program: the run's
# result is printed and the program goes on to exit 0, whatever failed.
_NOT_EXITING = {
    "exit=False": "unittest.main(argv=[''], exit=False)\n",
    "exit=False, kept": "program = unittest.main(argv=['tests'], exit=False, verbosity=0)\n",
    "a runner, then an assert": (
        "unittest.TextTestRunner().run(unittest.TestLoader().loadTestsFromTestCase(T))\n"
        "assert True\n"
    ),
}


@pytest.mark.parametrize("check", _NOT_EXITING.values(), ids=_NOT_EXITING.keys())
@pytest.mark.parametrize("answer", [RIGHT, WRONG], ids=["right", "wrong"])
async def test_a_unittest_run_that_does_not_exit_fails_with_its_tests(
    pool: SandboxPool, answer: str, check: str
) -> None:
    """Notebook-made tests call ``unittest.main(exit=False)``: the classic recipe exits 0
    after it whatever failed, and so every answer scored full marks here too. The run's
    result decides now: a step in which a ``unittest`` run failed fails."""
    tests = _unittest(check)
    assert classic(answer, tests)  # the classic recipe cannot tell them apart
    verdict = await judge(pool, answer, tests)
    assert verdict.judged and verdict.total == 1
    assert verdict.passed == (1 if answer == RIGHT else 0)


async def test_a_function_that_dies_in_one_call_fails_only_that_test(pool: SandboxPool) -> None:
    answer = "import os\ndef add(a, b):\n    if a < 0:\n        os._exit(0)\n    return a + b\n"
    tests = "assert add(2, 3) == 5\nassert add(-1, 4) == 3\nassert add(1, 1) == 2\n"
    assert await judge(pool, answer, tests) == Verdict(2, 3)


# -- holes the second red team found ---------------------------------------------------------


@pytest.mark.parametrize(
    "returned",
    [
        pytest.param("{10**5000: 1}", id="a dict keyed by a 5001-digit int"),
        pytest.param("{(1, 10**5000): 1}", id="a dict keyed by a tuple holding one"),
        pytest.param("[{10**5000: 1}]", id="such a dict inside a list"),
    ],
)
async def test_a_result_the_comparison_cannot_convert_scores_zero(
    pool: SandboxPool, returned: str
) -> None:
    """``str()`` of an int over 4300 digits raises: the comparison of a call test's result
    met it outside any per-test guard, and one answer stopped the training step with a
    SandboxBrokenError."""
    answer = f"def f(x):\n    return {returned}\n"
    tests = {"inputs": [[1], [2]], "outputs": [1, 2], "fn_name": "f"}
    verdict = await judge(pool, answer, tests)
    assert verdict == Verdict(0, 2)


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param("for x in range(1, 50):\n    assert sq(x) == x * x\n", id="for"),
        pytest.param("if True:\n    assert sq(3) == 9\n", id="if"),
        pytest.param("try:\n    assert sq(3) == 9\nexcept NameError:\n    pass\n", id="try"),
        pytest.param(
            "import contextlib\nwith contextlib.suppress(NameError):\n    assert sq(3) == 9\n",
            id="with",
        ),
        pytest.param("if sq(3) != 9:\n    raise AssertionError\n", id="a check without assert"),
        pytest.param(
            "def check(f):\n    assert f(3) == 9\nfor f in [sq]:\n    check(f)\n", id="call"
        ),
    ],
)
async def test_asserts_inside_top_level_statements_are_checked(
    pool: SandboxPool, tail: str
) -> None:
    """Only top-level ``assert`` statements counted, so the checks nested in a ``for``, an
    ``if``, a ``try`` or a ``with`` after the last of them were never seen to fail."""
    verdict = await judge(pool, "def sq(x):\n    return 0\n", "assert sq(0) == 0\n" + tail)
    assert verdict.score() == 0.0
    right = await judge(pool, "def sq(x):\n    return x * x\n", "assert sq(0) == 0\n" + tail)
    assert right.score() == 1.0


def test_top_level_statements_holding_asserts_are_tests() -> None:
    looped = "assert f(0) == 0\nfor x in range(3):\n    assert f(x) == x\n"
    assert parse_tests(looped).total == 2
    helper = "def helper(x):\n    assert x\nresult = helper(f(1))\n"
    assert parse_tests(helper).total == 1
    assert parse_tests("if True:\n    x = 1\n    assert f(x) == 1\n").total == 1
    assert parse_tests({"test": HUMANEVAL + "for c in [total]:\n    check(c)\n"}).total == 1


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("assert all(map(lambda x: f(x) == 2 * x, [1, 2, 3]))\n", id="map"),
        pytest.param(
            {
                "test": "def check(candidate):\n"
                "    for got, want in zip(map(candidate, [1, 2]), [2, 4]):\n"
                "        assert got == want\n",
                "entry_point": "f",
            },
            id="zip over map",
        ),
        pytest.param("assert [f(x) for x in [1, 2]] == [2, 4] or True is False\n", id="list"),
    ],
)
@pytest.mark.parametrize("raised", ["StopIteration", "StopAsyncIteration"])
async def test_stop_iteration_from_the_answer_fails_the_test(
    pool: SandboxPool, tests: object, raised: str
) -> None:
    """A StopIteration rebuilt in the harness inside ``map``'s ``__next__`` ended the
    iteration early, so ``all()`` saw nothing false; PEP 479 makes it a RuntimeError in a
    generator for the same reason."""
    verdict = await judge(pool, f"def f(x):\n    raise {raised}\n", tests)
    assert verdict.score() == 0.0


# -- tangram's failures are not the answer's ------------------------------------------------


async def test_a_sandbox_that_cannot_run_the_judge_raises() -> None:
    async with (
        SandboxPool(LocalBackend(python="/nonexistent/python3")) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("broken") as sandbox,
    ):
        with pytest.raises(SandboxBrokenError, match="did not start"):
            await grade(sandbox, RIGHT, TESTS)


@pytest.mark.parametrize(
    ("label", "error"),
    [
        ("x = 1\n", ValueError),
        ("assert add(2, 3) ==\n", ValueError),
        ({"inputs": ["1"], "outputs": []}, ValueError),
        ({"inputs": [], "outputs": []}, ValueError),
        ({"fn_name": "not a name", "inputs": [[1]], "outputs": [1]}, ValueError),
        ({"test": "def check(candidate):\n    pass\n"}, ValueError),
        ({"tests": "assert True"}, ValueError),
        (42, TypeError),
    ],
)
def test_a_label_with_nothing_to_run_fails_at_the_call(label: object, error: type) -> None:
    with pytest.raises(error):
        parse_tests(label)


async def test_bad_arguments_fail_at_the_call(pool: SandboxPool) -> None:
    async with pool.sandbox("args") as sandbox:
        with pytest.raises(TypeError, match="answer"):
            await grade(sandbox, b"print(1)", TESTS)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout"):
            await grade(sandbox, RIGHT, TESTS, timeout=0)


def test_labels_count_their_tests() -> None:
    assert parse_tests(TESTS).total == 2
    assert parse_tests(["assert f(1) == 1", "assert f(2) == 2"]).total == 2
    assert parse_tests({"test": HUMANEVAL, "entry_point": "total"}).total == 1
    assert parse_tests({"test": HUMANEVAL + "check(total)\n"}).total == 1
    assert parse_tests(STDIO).spec["kind"] == "stdio"
    assert parse_tests(json.dumps({"assert_case": ["assert f() == 1"]})).total == 1


# -- the pieces the harness is built from ---------------------------------------------------


@pytest.mark.parametrize(
    ("got", "want", "same"),
    [
        ("5\n", "5", True),
        ("YES\n", "yes", True),
        ("  1 2  \n3\n", "1 2\n3", True),
        ("0.3333333", "0.33333334", True),
        ("0.333", "0.334", False),
        ("1\n2\n", "1\n2\n3\n", False),
        ("1 2", "1  2", False),
        ("", "", True),
        ("1.0", "1", False),
        ("1", "1.0", True),
        ("1.0000001", "1.0", True),
        ("100000", "1e5", True),
        ("1E5", "100000.0", True),
        ("-.5", "-0.5", True),
        # Integers are compared exactly, and numbers are ASCII literals: not Python's float().
        pytest.param("999990001", "1000000000", False, id="int within 1e-5"),
        pytest.param("1000001", "1000000", False, id="int off by one"),
        pytest.param("123456789012345678", "123456789012345679", False, id="long int"),
        pytest.param("1_000", "1000", False, id="underscores"),
        pytest.param("1_000.0", "1000.0", False, id="underscores, decimal"),
        pytest.param("\uff11\uff12\uff13", "123", False, id="fullwidth digits"),
        pytest.param("\uff11\uff12\uff13.0", "123.0", False, id="fullwidth, decimal"),
        pytest.param("\u0661.\u0660", "1.0", False, id="arabic-indic digits"),
        pytest.param("1" * 200_000 + "x", "1.0", False, id="a long line that is no number"),
    ],
)
def test_standard_output_is_compared_as_sandboxfusion_compares_it(
    got: str, want: str, same: bool
) -> None:
    assert _checks.same_output(got, want) is same


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -3,
        pytest.param(2**20000, id="a 6021-digit int"),
        1.5,
        float("inf"),
        "text",
        [1, [2, (3,)]],
        {1: "a", (2, 3): {4}},
        frozenset({1}),
        b"\x00",
        bytearray(b"x"),
        1 - 2j,
    ],
)
def test_the_wire_carries_plain_values_unchanged(value: object) -> None:
    def no_handles(obj: object) -> int:
        raise AssertionError(f"{obj!r} should not need a handle")

    sent = json.loads(json.dumps(_wire.encode(value, no_handles)))
    back = _wire.decode(sent, lambda n: pytest.fail("no handles"))
    assert back == value
    assert type(back) is type(value)


def test_the_wire_carries_the_method_mark_only_as_an_attribute_reads_answer() -> None:
    sent = json.loads(json.dumps(_wire.encode(_wire.METHOD, lambda obj: 0)))
    assert sent == {"m": 0}
    assert _wire.decode(sent, lambda n: pytest.fail("no handles"), method=True) is _wire.METHOD
    for elsewhere, method in (({"m": 0}, False), ([{"m": 0}], True), ({"t": [{"m": 0}]}, True)):
        with pytest.raises(ValueError):
            _wire.decode(elsewhere, lambda n: n, method=method)


@pytest.mark.parametrize(
    "data",
    [
        {"eq": 1},
        {"t": "x"},
        {"f": "1e400"},
        {"d": [[1]]},
        {"a": 1, "b": 2},
        {"c": [1]},
        {"m": 1},
        {"m": False},
        {"m": "0"},
    ],
)
def test_the_wire_rejects_what_the_encoder_never_writes(data: object) -> None:
    with pytest.raises(ValueError):
        _wire.decode(data, lambda n: n)
