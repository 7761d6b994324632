"""Red team, rounds 3 and 4, on the code reward: the answer's names, arguments and limits.

The hacks themselves are in ``tests/_hacks.py`` (``ROUND_3``, run by ``test_grade.py``'s
``test_a_hack_scores_zero`` and by the adapters' reward tests). Here: the controls that
show the fixes did not cost right answers their score, the sweeps over every builtin an
answer can bind, and every limit an answer can lower in its judge at every stage.
"""

from __future__ import annotations

import builtins
import keyword

import pytest
from _grading import anyio_backend, classic, judge, pool, wrong_scores  # noqa: F401 (fixtures)
from _hacks import HUMANEVAL_4, HUMANEVAL_38, HUMANEVAL_38_PROMPT, MBPP_2, ROUND_3, WRONG, YES
from _reward_attacks import LEAK, LEAK_TESTS, LIMITS, ORACLE, ORACLE_TESTS, STAGES, limit_attack

import tangram
from tangram._reward._grade import grade
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import SandboxPool
from tangram.errors import InvalidSettingError, SandboxBrokenError

pytestmark = pytest.mark.anyio

RIGHT_ADD = "def add(a, b):\n    return a + b\n"

# A right answer for each round-3 hack's tests, several binding the same builtin the hack
# rebinds (correctly): a contested name must not cost a right answer its score.
RIGHT: dict[str, str] = {
    "rebind abs, which HumanEval/4's check uses for the distance": (
        "def abs(x):\n    return x if x >= 0 else -x\n"
        "def mean_absolute_deviation(numbers):\n"
        "    mean = sum(numbers) / len(numbers)\n"
        "    return sum(abs(x - mean) for x in numbers) / len(numbers)\n"
    ),
    "rebind set, which builds both sides of MBPP task 2": (
        "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n"
    ),
    "rebind sorted on both sides": "def add(a, b):\n    return [a + b]\n",
    "rebind len so the loop of asserts never runs": RIGHT_ADD,
    "rebind all to say yes": RIGHT_ADD + "from builtins import all\n",
    "rebind any to say no": RIGHT_ADD,
    "rebind range so the loop of asserts never runs": (
        RIGHT_ADD + "import builtins\ndef range(*a):\n    return list(builtins.range(*a))\n"
    ),
    "bind __name__ so every __main__ block is skipped": RIGHT_ADD + "__name__ = 'x'\n",
    "empty the argument the expected side is computed from": "def total(xs):\n    return sum(xs)\n",
    "empty the argument, compared in the next statement": "def total(xs):\n    return sum(xs)\n",
    "empty a dict argument the expected side reads": "def size(d):\n    return len(d)\n",
}


def test_every_round_3_hack_has_a_right_answer() -> None:
    assert set(RIGHT) == set(ROUND_3)


@pytest.mark.parametrize("name", sorted(ROUND_3))
async def test_a_right_answer_to_the_round_3_tests_scores_one(pool: SandboxPool, name: str) -> None:
    verdict = await judge(pool, RIGHT[name], ROUND_3[name].tests)
    assert verdict.score() == 1.0, verdict


async def test_the_verbatim_dataset_tests_score_their_reference_answers(pool: SandboxPool) -> None:
    mad = RIGHT["rebind abs, which HumanEval/4's check uses for the distance"].split("def mean")[1]
    assert (await judge(pool, "def mean" + mad, HUMANEVAL_4)).score() == 1.0
    similar = RIGHT["rebind set, which builds both sides of MBPP task 2"]
    assert (await judge(pool, similar, MBPP_2)).score() == 1.0


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(
            "def sum(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n",
            "assert sum([1, 2, 3]) == 6\nassert sum([]) == 0\n",
            id="a task whose function is named sum",
        ),
        pytest.param(
            "def max(xs):\n    best = xs[0]\n    for x in xs:\n"
            "        best = x if x > best else best\n    return best\n",
            "assert max([1, 5, 2]) == 5\nassert max([3]) == 3\n",
            id="a task whose function is named max",
        ),
    ],
)
async def test_a_right_function_named_like_a_builtin_still_scores_one(
    pool: SandboxPool, answer: str, tests: str
) -> None:
    assert (await judge(pool, answer, tests)).score() == 1.0


# -- every builtin name an answer can bind -----------------------------------------------

# Every name of the builtins module an answer can assign (keywords and ``__debug__`` are
# not assignable), dunders included.
BINDABLE = sorted(
    name for name in dir(builtins) if not keyword.iskeyword(name) and name != "__debug__"
)


async def test_no_builtin_the_answer_binds_decides_what_the_tests_expect(
    pool: SandboxPool,
) -> None:
    """Each test expects ``(NAME and 4)``: 4 for the real builtin, 0 where the answer's
    ``NAME = 0`` is read instead, which the wrong ``add`` returns. One grading holds a test
    per name, so ``passed`` counts the names through which a wrong answer scored."""
    answer = WRONG + "".join(f"{name} = 0\n" for name in BINDABLE)
    tests = "".join(f"assert add(2, 2) == ({name} and 4)\n" for name in BINDABLE)
    verdict = await judge(pool, answer, tests, timeout=30.0)
    assert verdict.total == len(BINDABLE)
    assert verdict.passed == 0, verdict


async def test_in_place_functions_the_tests_check_still_pass(pool: SandboxPool) -> None:
    """An argument changes here only after a call that returns None, as Python's own
    in-place functions do; what they change is what the tests check."""
    answer = (
        "def sort_in_place(xs):\n    xs.sort()\n"
        "def fill(d):\n    d['k'] = 1\n"
        "def grow(s):\n    s.add(3)\n"
        "def upper(b):\n    b[:] = b.upper()\n"
    )
    tests = (
        "xs = [3, 1]\nsort_in_place(xs); assert xs == [1, 3]\n"
        "d = {}\nassert fill(d) is None and d == {'k': 1}\n"
        "s = {1}\ngrow(s)\nassert s == {1, 3}\n"
        "b = bytearray(b'ab')\nupper(b)\nassert b == b'AB'\n"
    )
    assert (await judge(pool, answer, tests)).score() == 1.0
    lazy = "def sort_in_place(xs):\n    pass\n" + answer.split("\n", 2)[2]
    assert (await judge(pool, lazy, tests)).passed == 3


# -- every limit an answer can lower in its judge, at every stage --------------------------


@pytest.mark.parametrize("kind", ["assert", "call", "stdio"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("limit", LIMITS)
async def test_a_judge_limit_the_answer_lowers_never_stops_the_step(
    pool: SandboxPool, limit: str, stage: str, kind: str
) -> None:
    """The answer runs under its judge's uid, so it may lower any of the judge's limits
    (``prlimit``): here before its first case, between cases, and in the last one, with a
    later input of 256 KiB that the judge must still prepare. Whatever the judge then fails
    at is the answer's doing and costs the answer its tests; it never becomes the
    infrastructure failure (SandboxBrokenError) that stops the training step."""
    answer, tests = limit_attack(limit, stage, kind)
    try:
        verdict = await judge(pool, answer, tests)
    except SandboxBrokenError as exc:
        pytest.fail(f"a wrong answer turned its 0 into an infrastructure failure: {exc}")
    assert verdict.score() == 0.0, verdict


# -- round 3, second review -----------------------------------------------------------------


async def test_an_object_the_tests_built_keeps_every_method(pool: SandboxPool) -> None:
    """Methods named like a builtin value's are refused only on objects the answer
    returned, not on one the tests built from the answer's class (``Stack().pop()``)."""
    answer = (
        "class Stack:\n"
        "    def __init__(self):\n        self.items = []\n"
        "    def append(self, x):\n        self.items.append(x)\n"
        "    def pop(self):\n        return self.items.pop()\n"
    )
    tests = "s = Stack()\ns.append(1)\ns.append(2)\nassert s.pop() == 2\nassert s.pop() == 1\n"
    assert (await judge(pool, answer, tests)).score() == 1.0


async def test_an_answer_that_is_not_utf8_scores_zero_and_a_label_is_refused(
    pool: SandboxPool,
) -> None:
    """A lone surrogate (text decoded with ``surrogateescape``) in the answer made the
    harness fail to encode it, before the answer ran: ``SandboxBrokenError``."""
    verdict = await judge(pool, RIGHT_ADD + "# \udce9\n", "assert add(2, 3) == 5\n")
    assert verdict.score() == 0.0 and verdict.total == 1
    with pytest.raises(InvalidSettingError, match="not UTF-8"):
        await judge(pool, RIGHT_ADD, {"inputs": ["2 3\udce9\n"], "outputs": ["5\n"]})


async def test_the_prompts_helpers_are_the_tests_and_its_stub_is_the_answers(
    pool: SandboxPool,
) -> None:
    """HumanEval/38 with its prompt: a right ``decode_cyclic`` scores 1.0 against the
    prompt's own ``encode_cyclic``, whatever the answer defines under that name."""
    decode = (
        "def decode_cyclic(s):\n"
        "    groups = [s[(3 * i):min((3 * i + 3), len(s))] for i in range((len(s) + 2) // 3)]\n"
        "    groups = [(g[-1] + g[:-1]) if len(g) == 3 else g for g in groups]\n"
        "    return ''.join(groups)\n"
    )
    label = {**HUMANEVAL_38, "prompt": HUMANEVAL_38_PROMPT}
    assert (await judge(pool, HUMANEVAL_38_PROMPT + decode, label)).score() == 1.0
    lying = decode + "def encode_cyclic(s):\n    return s\n"
    assert (await judge(pool, lying, label)).score() == 1.0  # the prompt's is used
    with pytest.raises(InvalidSettingError, match="prompt"):
        await judge(pool, decode, {**HUMANEVAL_38, "prompt": "def ("})


# -- round 3, third review: right answers the classic recipe passes ----------------------------


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(
            "from collections import Counter\ndef freq(xs):\n    return Counter(xs)\n",
            "assert freq([1, 2, 2]) == {1: 1, 2: 2}\n",
            id="a Counter",
        ),
        pytest.param(
            "from collections import defaultdict\ndef group(xs):\n"
            "    d = defaultdict(list)\n    for x in xs:\n        d[x % 2].append(x)\n"
            "    return d\n",
            "assert group([1, 2, 3]) == {1: [1, 3], 0: [2]}\n",
            id="a defaultdict",
        ),
        pytest.param(
            "from collections import namedtuple\nP = namedtuple('P', 'x y')\n"
            "def point():\n    return [P(1, 2)]\n",
            "assert point() == [(1, 2)]\n",
            id="namedtuples in a list",
        ),
        pytest.param(
            "def evens(n):\n    return (i for i in range(n) if i % 2 == 0)\n",
            "assert list(evens(5)) == [0, 2, 4]\ng = evens(5)\nassert next(g) == 0\n",
            id="a generator",
        ),
        pytest.param(
            "def keys(d):\n    return d.keys()\ndef span(n):\n    return range(n)\n",
            "assert sorted(keys({'b': 1, 'a': 2})) == ['a', 'b']\n"
            "assert list(span(3)) == [0, 1, 2]\n",
            id="a dict view and a range",
        ),
        pytest.param(
            "def copy(xs):\n    return list(xs)\n",
            "assert copy([1, 2]) == [1, 2]\n",
            id="a task function named like a standard module",
        ),
        pytest.param(
            RIGHT_ADD,
            "assert add(2, 3) == 5\nimport sys\nsys.exit(0)\n",
            id="tests that end the program with status 0",
        ),
    ],
)
async def test_right_answers_the_classic_recipe_passes_score_one(
    pool: SandboxPool, answer: str, tests: str
) -> None:
    """Results that are subclasses of the builtins or iterators travel as the builtin
    values (they were opaque handles that compared equal to nothing); a task's own
    ``def copy`` is the answer's; tests that exit 0 end as one program would."""
    assert (await judge(pool, answer, tests)).score() == 1.0


@pytest.mark.parametrize(
    "program",
    [
        pytest.param("import sys\nsys.__stdout__.write(OUT)\n", id="sys.__stdout__"),
        pytest.param("open(1, 'w').write(OUT)\n", id="a file opened on descriptor 1"),
        pytest.param(
            "import atexit, sys\nout = sys.stdout\natexit.register(lambda: out.write(OUT))\n",
            id="an atexit hook",
        ),
        pytest.param(
            "import threading\nthreading.Thread(target=lambda: print(OUT, end='')).start()\n",
            id="a thread that outlives the main one",
        ),
        pytest.param(
            "import sys\nsys.stdout.write(OUT)\nsys.stdout.flush()\nsys.stdout.close()\n",
            id="stdout closed at the end",
        ),
    ],
)
async def test_a_program_ends_as_python_c_would(pool: SandboxPool, program: str) -> None:
    """Input/output answers run in a process forked from the harness's, which must end as
    ``python -c`` ends: output written past ``sys.stdout`` was lost (a right program
    scored 0), and the exit status must be the interpreter's own."""
    tests = {"inputs": ["2 3\n"], "outputs": ["5\n"]}
    right = "a, b = map(int, input().split())\nOUT = f'{a + b}\\n'\n" + program
    assert (await judge(pool, right, tests)).score() == 1.0
    wrong = right.replace("a + b", "a - b")
    assert (await judge(pool, wrong, tests)).score() == 0.0
    failing = right + "raise SystemExit(3)\n"
    assert (await judge(pool, failing, tests)).score() == 0.0


async def test_an_entry_point_declared_a_function_is_never_an_object_the_tests_built(
    pool: SandboxPool,
) -> None:
    """An answer whose entry point is a class answering yes to every method: the
    prompt declares it with ``def``, so what it returns is a result, not an object the
    tests chose to build, and ``startswith`` on it is refused."""
    answer = YES + "class title(Yes):\n    def __init__(self, s):\n        pass\n"
    label = {
        "test": "def check(candidate):\n    assert candidate('ab cd').startswith('Ab Cd')\n",
        "entry_point": "title",
        "prompt": "def title(s: str) -> str:\n    '''Title-case s.'''\n",
    }
    assert (await judge(pool, answer, label)).passed == 0


# -- round 4: what the answer binds, seen where it runs; the sandbox's failures; exceptions


MAX_TESTS = "assert max([1, 5, 2]) == 5\nassert max([3]) == 3\nassert max([-4, -9]) == -4\n"


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param("# coding: bogus\ndef max(xs):\n    return 0\n", id="a bogus coding cookie"),
        pytest.param("if True:\n    def max(xs):\n        return 0\n", id="a def under an if"),
        pytest.param(
            "try:\n    def max(xs):\n        return 0\nexcept Exception:\n    pass\n",
            id="a def under a try",
        ),
        pytest.param("globals()['max'] = lambda xs: 0\n", id="bound through globals()"),
        pytest.param("for max in [lambda xs: 0]:\n    pass\n", id="a for loop's target"),
        pytest.param("import builtins\nbuiltins.max = lambda xs: 0\n", id="builtins patched"),
        pytest.param("import builtins\ndel builtins.max\n", id="the builtin deleted"),
        pytest.param(
            "exec('def max(xs):\\n    return 0')\n", id="defined by exec, which no parse reads"
        ),
    ],
)
async def test_a_builtin_the_answer_binds_anywhere_is_contested(
    pool: SandboxPool, answer: str
) -> None:
    """Which builtins the answer binds was read from a parse of its top level: one bound
    any other way was read as the real one, so a wrong ``max`` scored 1.0 where the classic
    recipe calls it and fails. The answer's process now says what it binds, as it runs."""
    assert not classic(answer, MAX_TESTS)
    assert (await judge(pool, answer, MAX_TESTS)).score() == 0.0


async def test_a_builtin_bound_by_a_call_during_the_tests_is_contested(pool: SandboxPool) -> None:
    """Bound after the answer loaded, by a function the tests call: the tests are planned
    and run again with the name contested, in every reading."""
    answer = "def setup():\n    global max\n    max = lambda xs: 0\n"
    tests = "setup()\n" + MAX_TESTS
    assert not classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 0.0
    right = "def setup():\n    global max\n    max = lambda xs: sorted(xs)[-1]\n"
    assert classic(right, tests)
    assert (await judge(pool, right, tests)).score() == 1.0


@pytest.mark.parametrize("processes", [4, 5])
async def test_a_sandbox_that_cannot_fork_the_answer_is_the_sandboxs_failure(
    processes: int,
) -> None:
    """Room for the harness and its forker but not for an answer process (a low
    ``processes``, or a shared user's process limit that other sandboxes fill): none of
    the answer ran, yet a right answer scored 0, as if the failure were its own."""
    async with (
        SandboxPool(LocalBackend(processes=processes), warm=1) as sandboxes,
        tangram.Runtime(capacity=sandboxes.capacity()),
        sandboxes.sandbox("starved") as sandbox,
    ):
        with pytest.raises(SandboxBrokenError):
            await grade(sandbox, RIGHT_ADD, "assert add(2, 3) == 5\n", timeout=8.0)


DEPTH = "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(DEPTH, "assert depth(995) == 995\n", id="a call"),
        pytest.param(
            "import sys\nsys.setrecursionlimit(1100)\n" + DEPTH,
            "assert depth(1092) == 1092\n",
            id="under its own limit",
        ),
        pytest.param(
            "import sys\n"
            "def limits():\n"
            "    before = sys.getrecursionlimit()\n"
            "    sys.setrecursionlimit(before + 7)\n"
            "    after = sys.getrecursionlimit()\n"
            "    sys.setrecursionlimit(before)\n"
            "    try:\n        sys.setrecursionlimit(0)\n    except ValueError:\n"
            "        return after - before\n",
            "assert limits() == 7\n",
            id="its limit as it set it",
        ),
        pytest.param(
            "import sys\nsys.setrecursionlimit(2**31 - 1)\n" + DEPTH,
            "assert depth(3000) == 3000\n",
            id="the largest limit",
        ),
        pytest.param(
            "import sys\n"
            "def refused():\n"
            "    said = []\n"
            "    for limit in (2**31, 0, '9'):\n"
            "        try:\n            sys.setrecursionlimit(limit)\n"
            "        except (OverflowError, ValueError, TypeError) as e:\n"
            "            said.append(type(e).__name__)\n"
            "    return said\n",
            "assert refused() == ['OverflowError', 'ValueError', 'TypeError']\n",
            id="limits Python refuses",
        ),
        pytest.param(
            "import sys\nsys.setrecursionlimit(2**31 - 1)\n"
            + DEPTH
            + "print(depth(int(input())))\n",
            {"inputs": ["3000\n"], "outputs": ["3000\n"]},
            id="the largest limit, a program",
        ),
        pytest.param(
            DEPTH + "print(depth(int(input())))\n",
            {"inputs": ["993\n"], "outputs": ["993\n"]},
            id="a program",
        ),
    ],
)
async def test_a_recursion_the_classic_recipe_allows_is_allowed(
    pool: SandboxPool, answer: str, tests: object
) -> None:
    """The answer ran below the harness's own frames under the same recursion limit: a
    recursion 993 deep passed the classic recipe and overflowed here."""
    if isinstance(tests, str):
        assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 1.0


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(
            "def get(d, k):\n    return d[k]\n",
            "try:\n    get({}, 'x')\n    ok = False\nexcept KeyError as e:\n"
            "    ok = str(e) == \"'x'\" and e.args == ('x',)\nassert ok\n",
            id="a KeyError's text and args",
        ),
        pytest.param(
            "def check(v):\n    raise ValueError('bad value', v)\n",
            "try:\n    check(7)\nexcept ValueError as e:\n    assert e.args == ('bad value', 7)\n",
            id="args of several values",
        ),
        pytest.param(
            "def text(b):\n    return b.decode('utf-8')\n",
            "try:\n    text(b'\\xff')\n    ok = False\n"
            "except ValueError:\n    ok = True\nassert ok\n",
            id="a UnicodeDecodeError caught as ValueError",
        ),
        pytest.param(
            "import json\ndef parse(s):\n    return json.loads(s)\n",
            "try:\n    parse('{')\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok\n",
            id="a JSONDecodeError caught as ValueError",
        ),
        pytest.param(
            "class Empty(LookupError):\n    pass\ndef first(xs):\n    if not xs:\n"
            "        raise Empty('no item')\n    return xs[0]\n",
            "try:\n    first([])\n    ok = False\nexcept LookupError as e:\n"
            "    ok = str(e) == 'no item'\nassert ok\n",
            id="the answer's own subclass of a builtin",
        ),
    ],
)
async def test_an_exception_reaches_the_tests_as_raised(
    pool: SandboxPool, answer: str, tests: str
) -> None:
    """Rebuilt from its text, a ``KeyError('x')`` said ``"'x'"`` and its ``args`` were
    that text; one whose class was not a builtin (``JSONDecodeError``) or whose builtin
    takes no single string (``UnicodeDecodeError``) was caught by no ``except ValueError``.
    It is now the nearest builtin of its class, made from its arguments."""
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 1.0


@pytest.mark.parametrize(
    "raised",
    ["StopIteration()", "StopAsyncIteration()", "SystemExit(0)", "KeyboardInterrupt()"],
)
async def test_an_exception_that_steers_control_flow_is_still_never_rebuilt(
    pool: SandboxPool, raised: str
) -> None:
    """Its bases travel now: a subclass of ``StopIteration`` (or an exception the answer
    names so) must still not end the tests' iteration as the real one would."""
    answer = (
        f"class Sneaky({raised.split('(')[0]}):\n    pass\ndef is_even(n):\n    raise Sneaky()\n"
    )
    tests = "assert all(map(is_even, [1, 3, 5]))\n"
    assert (await judge(pool, answer, tests)).score() == 0.0


BANK = (
    "class BankError(Exception):\n    pass\n"
    "class InsufficientFunds(BankError):\n"
    "    def __init__(self, balance, amount):\n"
    "        super().__init__(f'balance {balance} < {amount}')\n"
    "class Account:\n"
    "    def __init__(self, balance):\n        self.balance = balance\n"
    "    def withdraw(self, amount):\n"
    "        if amount > self.balance:\n"
    "            raise InsufficientFunds(self.balance, amount)\n"
    "        self.balance -= amount\n"
    "        return self.balance\n"
)
# Wrong: it raises a builtin where the task asks for its own class.
BANK_WRONG = BANK.replace("raise InsufficientFunds(self.balance, amount)", "raise ValueError('no')")
AGES = (
    "InvalidAge = ValueError\n"
    "def set_age(age):\n"
    "    if age < 0:\n"
    "        raise InvalidAge('negative')\n"
    "    return age\n"
)
PARSER = (
    "class ParseError(ValueError):\n"
    "    def __init__(self, line):\n        self.line = line\n"
    "    def __str__(self):\n        return f'line {self.line}'\n"
    "def parse(text):\n"
    "    for number, line in enumerate(text.splitlines(), 1):\n"
    "        if not line.strip().isdigit():\n            raise ParseError(number)\n"
    "    return [int(line) for line in text.splitlines()]\n"
)


@pytest.mark.parametrize(
    ("tests", "right", "wrong"),
    [
        pytest.param(
            "import unittest\n"
            "class T(unittest.TestCase):\n"
            "    def test_over(self):\n"
            "        with self.assertRaises(InsufficientFunds):\n"
            "            Account(5).withdraw(10)\n"
            "    def test_ok(self):\n"
            "        self.assertEqual(Account(5).withdraw(3), 2)\n"
            "unittest.main()\n",
            BANK,
            BANK_WRONG,
            id="assertRaises",
        ),
        pytest.param(
            "try:\n    Account(5).withdraw(10)\n    ok = False\n"
            "except BankError as e:\n    ok = str(e) == 'balance 5 < 10'\nassert ok\n",
            BANK,
            BANK_WRONG,
            id="except its base",
        ),
        pytest.param(
            "try:\n    Account(1).withdraw(2)\nexcept Exception as e:\n    err = e\n"
            "assert isinstance(err, InsufficientFunds) and isinstance(err, BankError)\n"
            "assert issubclass(InsufficientFunds, BankError)\n",
            BANK,
            BANK.replace(
                "class InsufficientFunds(BankError)", "class InsufficientFunds(Exception)"
            ),
            id="isinstance and issubclass",
        ),
        pytest.param(
            "try:\n    parse('1\\nx')\n    ok = False\n"
            "except ParseError as e:\n    ok = str(e) == 'line 2'\nassert ok\n"
            "assert parse('1\\n2') == [1, 2]\n",
            PARSER,
            PARSER.replace(
                "number, line in enumerate(text.splitlines(), 1)",
                "number, line in enumerate(text.splitlines())",
            ),
            id="its own __str__",
        ),
        pytest.param(
            "try:\n    check(-1)\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok\n",
            "class NegativeError(ValueError):\n    pass\n"
            "def check(n):\n    if n < 0:\n        raise NegativeError(n)\n",
            # Wrong: what it raises is another class of the same name, no ValueError.
            "class NegativeError(ValueError):\n    pass\n"
            "def check(n):\n"
            "    class NegativeError(Exception):\n        pass\n"
            "    if n < 0:\n        raise NegativeError(n)\n",
            id="a class of the same name, raised",
        ),
        pytest.param(
            "try:\n    set_age(-1)\n    ok = False\nexcept InvalidAge:\n    ok = True\n"
            "assert ok and set_age(3) == 3\n",
            AGES,
            AGES.replace("raise InvalidAge('negative')", "raise TypeError('negative')"),
            id="an alias of a builtin",
        ),
        pytest.param(
            "import unittest\n"
            "class T(unittest.TestCase):\n"
            "    def test_over(self):\n"
            "        with self.assertRaises(NoFunds):\n"
            "            Account(5).withdraw(10)\n"
            "unittest.main()\n",
            BANK + "NoFunds = InsufficientFunds\n",
            BANK_WRONG + "NoFunds = InsufficientFunds\n",
            id="an alias of its own class",
        ),
        pytest.param(
            "try:\n    set_age(-1)\n    ok = False\nexcept InvalidAge:\n    ok = True\nassert ok\n",
            AGES,
            # Wrong: what it raises is a class of the alias's name, no ValueError.
            AGES.replace(
                "    if age < 0:",
                "    class InvalidAge(Exception):\n        pass\n    if age < 0:",
            ),
            id="a class of an alias's name, raised",
        ),
        pytest.param(
            "try:\n    set_age(-1)\n    ok = False\nexcept InvalidAge:\n    ok = True\nassert ok\n",
            AGES,
            # Wrong: the name is bound again, to a function, before the tests run.
            AGES + "def InvalidAge(*args):\n    return TypeError(*args)\n",
            id="an alias bound again",
        ),
        pytest.param(
            "try:\n    set_age(-1)\n    ok = False\nexcept InvalidAge:\n    ok = True\n"
            "assert ok and set_age(3) == 3\n",
            AGES.replace("InvalidAge = ValueError", "InvalidAge: type = ValueError"),
            AGES.replace("InvalidAge = ValueError", "InvalidAge: type = ValueError").replace(
                "raise InvalidAge('negative')", "raise TypeError('negative')"
            ),
            id="an annotated alias",
        ),
        pytest.param(
            "try:\n    parse('1\\nx')\n    ok = False\n"
            "except ParseError as e:\n    ok = e.line == 2\nassert ok\n",
            PARSER,
            PARSER.replace(
                "number, line in enumerate(text.splitlines(), 1)",
                "number, line in enumerate(text.splitlines())",
            ),
            id="its attributes",
        ),
        pytest.param(
            "try:\n    check(-1)\n    ok = False\n"
            "except ValueError as e:\n    ok = e.code == 3 and e.value == [-1]\nassert ok\n",
            "def check(n):\n"
            "    if n < 0:\n"
            "        e = ValueError('negative')\n"
            "        e.code, e.value = 3, [n]\n"
            "        raise e\n",
            "def check(n):\n"
            "    if n < 0:\n"
            "        e = ValueError('negative')\n"
            "        e.code, e.value = 3, [0]\n"
            "        raise e\n",
            id="a builtin's attributes",
        ),
    ],
)
async def test_the_answers_exception_classes_are_classes_to_the_tests(
    pool: SandboxPool, tests: str, right: str, wrong: str
) -> None:
    """Class-design tasks test that the answer raises its own exceptions: the tests'
    ``InsufficientFunds`` was a stand-in for calling the answer, no class, so
    ``assertRaises`` and ``except`` raised ``TypeError`` and a right answer scored 0."""
    assert await wrong_scores(pool, tests, right, wrong) < 1.0


# Learns from the tests' reaction: a failing assert's message calls it again at once with
# the same input. It then binds a builtin the tests use, which restarted the round and
# threw the failing step away, and answers the other way from then on (a file keeps what
# it learnt across its processes).
LEARNS = (
    "import json, builtins\n"
    "_F = 'learnt.json'\n"
    "try:\n    _S = json.load(open(_F))\n"
    "except Exception:\n    _S = {'flip': [], 'used': []}\n"
    "_seen = []\n"
    "def is_prime(n):\n"
    "    if _seen and _seen[-1] == n and n not in _S['flip']:\n"
    "        _S['flip'].append(n)\n"
    "        for name in ('len', 'str', 'sum', 'abs', 'range', 'print'):\n"
    "            if name not in _S['used']:\n"
    "                _S['used'].append(name)\n"
    "                real = getattr(builtins, name)\n"
    "                globals()[name] = lambda *a, _r=real, **k: _r(*a, **k)\n"
    "                break\n"
    "        json.dump(_S, open(_F, 'w'))\n"
    "    _seen.append(n)\n"
    "    return n not in _S['flip']\n"
)
LEARNS_TESTS = (
    "def check(candidate):\n"
    "    assert candidate(7) == True, f'7 gave {candidate(7)}'\n"
    "    assert candidate(8) == False, f'8 gave {candidate(8)}'\n"
    "    assert candidate(9) == False, f'9 gave {candidate(9)}'\n"
    "    assert candidate(13) == True, f'13 gave {candidate(13)}'\n"
    "    assert len(str(sum([1, 2]))) == 1\n"
)


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param({"test": LEARNS_TESTS, "entry_point": "is_prime"}, id="check(candidate)"),
        pytest.param(
            "assert is_prime(7) == True, f'7 gave {is_prime(7)}'\n"
            "assert is_prime(8) == False, f'8 gave {is_prime(8)}'\n"
            "assert is_prime(9) == False, f'9 gave {is_prime(9)}'\n"
            "assert len(str(sum([1, 2]))) == 1\n",
            id="asserts",
        ),
    ],
)
async def test_a_step_cut_by_a_rebinding_after_its_answers_counts_as_failed(
    pool: SandboxPool, tests: object
) -> None:
    """A hostile re-review: binding a builtin mid-step restarted the round and discarded
    the step it cut, so an answer that learnt from the step's failure (a message calling
    it again) answered right in the next round and scored 1.0. A step cut after one of
    its calls has answered now counts as failed; one cut at its first call (a right
    answer binding as it starts) runs again."""
    assert (await judge(pool, LEARNS, tests)).score() < 0.5


_NAMED_POINT = "from typing import NamedTuple\nclass Point(NamedTuple):\n    x: int\n    y: int\n"
_DIST = (
    _NAMED_POINT + "    def dist(self, other):\n"
    "        return ((self.x - other.x) ** 2 + (self.y - other.y) ** 2) ** 0.5\n"
)
_STACK_LIST = "class Stack(list):\n    def push(self, item):\n        self.append(item)\n"


@pytest.mark.parametrize(
    ("tests", "right", "wrong"),
    [
        pytest.param(
            "assert Point(1, 2) != Point(1, 3)\nassert Point(1, 2) == Point(1, 2)\n",
            _NAMED_POINT,
            _NAMED_POINT + "    def __eq__(self, other):\n        return self.x == other.x\n"
            "    def __ne__(self, other):\n        return not self == other\n"
            "    __hash__ = tuple.__hash__\n",
            id="a namedtuple's own ==",
        ),
        pytest.param(
            "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and len(s) == 1\n",
            _STACK_LIST,
            _STACK_LIST + "    def pop(self):\n        return self[0]\n",
            id="a list's own pop",
        ),
        pytest.param(
            "assert Point(0, 0).dist(Point(3, 4)) == 5\n",
            _DIST,
            _DIST.replace("** 0.5", "** 0.5 - 1"),
            id="a namedtuple's method",
        ),
        pytest.param(
            "assert color() == 'red' and color() != 'blue'\n",
            "import enum\nclass Color(str, enum.Enum):\n    RED = 'red'\n    BLUE = 'blue'\n"
            "def color():\n    return Color.RED\n",
            "import enum\nclass Color(str, enum.Enum):\n    RED = 'red'\n    BLUE = 'blue'\n"
            "def color():\n    return Color.BLUE\n",
            id="an Enum of str, as its value",
        ),
    ],
)
async def test_a_builtins_subclass_with_its_own_behaviour_keeps_it(
    pool: SandboxPool, tests: str, right: str, wrong: str
) -> None:
    """A hostile re-review: a subclass of a builtin value travelled as that value, so its
    own ``__eq__`` or ``pop`` was never asked (a wrong one passed) and its methods could
    not be called (a right ``Stack(list).push`` scored 0). One that defines behaviour of
    its own stays the answer's object; an ``Enum`` of ``str`` is its value (it said
    ``"Color.RED"``)."""
    assert await wrong_scores(pool, tests, right, wrong) == 0.0


SHAPES = (
    "class Shape:\n    pass\n"
    "class Square(Shape):\n    def __init__(self, side):\n        self.side = side\n"
    "def make(side):\n    return Square(side)\n"
)


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param(
            "sq = make(2)\nassert isinstance(sq, Square) and isinstance(sq, Shape)\n",
            id="a returned object",
        ),
        pytest.param(
            "assert isinstance(Square(1), Shape) and not isinstance(5, Shape)\n"
            "assert isinstance(make(1), (int, Square))\n",
            id="a built object, a tuple, a value",
        ),
        pytest.param(
            "import unittest\n"
            "class T(unittest.TestCase):\n"
            "    def test_kind(self):\n"
            "        self.assertIsInstance(make(2), Square)\n"
            "        self.assertNotIsInstance(make(2), int)\n"
            "unittest.main()\n",
            id="assertIsInstance",
        ),
    ],
)
async def test_isinstance_asks_the_answers_class(pool: SandboxPool, tests: str) -> None:
    """Class-design tests check what kind of object came back: the tests' ``Square`` was
    a stand-in for calling the answer, no class, and ``isinstance`` raised ``TypeError``
    for a right answer."""
    wrong = SHAPES.replace("return Square(side)", "return Shape()")
    assert classic(SHAPES, tests) and not classic(wrong, tests)
    assert (await judge(pool, SHAPES, tests)).score() == 1.0
    assert (await judge(pool, wrong, tests)).score() == 0.0


STACK = (
    "class Stack:\n"
    "    def __init__(self):\n        self.items = []\n"
    "    def push(self, x):\n        self.items.append(x)\n"
    "    def __len__(self):\n        return len(self.items)\n"
    "    def __iter__(self):\n        return iter(self.items)\n"
    "    def __getitem__(self, i):\n        return self.items[i]\n"
    "    def __str__(self):\n        return f'Stack({self.items})'\n"
    "    def __repr__(self):\n        return 'S' + str(self.items)\n"
)


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2\n", id="len"),
        pytest.param("s = Stack()\nassert not s\ns.push(1)\nassert s\n", id="truth"),
        pytest.param("s = Stack()\ns.push(1)\nassert list(s) == [1]\n", id="iter"),
        pytest.param("s = Stack()\ns.push(7)\nassert s[0] == 7 and s[-1] == 7\n", id="index"),
        pytest.param("s = Stack()\ns.push(7)\nassert 7 in s and 8 not in s\n", id="in"),
        pytest.param("s = Stack()\ns.push(7)\nassert str(s) == 'Stack([7])'\n", id="str"),
        pytest.param("s = Stack()\ns.push(7)\nassert repr(s) == 'S[7]'\n", id="repr"),
    ],
)
async def test_an_object_the_tests_built_answers_pythons_protocols(
    pool: SandboxPool, tests: str
) -> None:
    """Class-design tasks test their objects through ``len(s)``, ``list(s)``, ``s[0]`` and
    ``str(s)``: the tests' stand-in for the answer's object answered none of them, and a
    right ``Stack`` the classic recipe passes scored 0."""
    assert classic(STACK, tests)
    assert (await judge(pool, STACK, tests)).score() == 1.0


_NODE = (
    "class Node:\n"
    "    def __init__(self, val, next=None):\n"
    "        self.val, self.next = val, next\n"
    "def reverse(head):\n"
    "    prev = None\n"
    "    while head:\n"
    "        head.next, prev, head = prev, head, head.next\n"
    "    return prev\n"
)
_ACCOUNT = (
    "class Account:\n"
    "    rate = 0.5\n"
    "    def __init__(self, balance):\n        self.balance = balance\n"
    "    def deposit(self, n):\n        self.balance += n\n        return self.balance\n"
    "    @property\n"
    "    def doubled(self):\n        return 2 * self.balance\n"
    "def adder(n):\n"
    "    def add(x):\n        return x + n\n"
    "    return add\n"
)


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(_ACCOUNT, "a = Account(100)\nassert a.balance == 100\n", id="attribute"),
        pytest.param(
            _ACCOUNT,
            "a = Account(100)\nassert a.deposit(50) == 150\nassert a.balance == 150\n",
            id="after a method",
        ),
        pytest.param(_ACCOUNT, "assert Account(3).doubled == 6\n", id="property"),
        pytest.param(_ACCOUNT, "assert Account(3).rate == 0.5\n", id="class attribute"),
        pytest.param(
            _ACCOUNT,
            "a = Account(1)\nassert not hasattr(a, 'missing')\n"
            "try:\n    a.missing\nexcept AttributeError:\n    pass\n"
            "else:\n    raise AssertionError\n",
            id="missing",
        ),
        pytest.param(_ACCOUNT, "add5 = adder(5)\nassert add5(3) == 8\n", id="returned closure"),
        pytest.param(_ACCOUNT, "assert Account.rate == 0.5\n", id="the class's attribute"),
        pytest.param(
            "class Geometry:\n"
            "    @staticmethod\n"
            "    def area(r):\n        return 3 * r * r\n"
            "import functools\n"
            "@functools.lru_cache(maxsize=None)\n"
            "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
            "assert Geometry.area(2) == 12\nassert fib(10) == 55\n"
            "fib.cache_clear()\nassert fib(12) == 144\n",
            id="a class's static method, a cache's method",
        ),
        pytest.param(
            _NODE,
            "h = reverse(Node(1, Node(2, Node(3))))\n"
            "assert [h.val, h.next.val, h.next.next.val] == [3, 2, 1]\n"
            "assert h.next.next.next is None\n",
            id="linked list",
        ),
    ],
)
async def test_the_tests_read_the_answers_attributes_and_call_what_it_returns(
    pool: SandboxPool, answer: str, tests: str
) -> None:
    """``p.x``, ``node.next.val`` and ``make_adder(5)(3)``: a stand-in's every attribute
    was a method to call, and a returned function could not be called, so right
    answers the classic recipe passes scored 0 (a fidelity review)."""
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 1.0


_SHAPES = (
    "from dataclasses import dataclass\n"
    "@dataclass\n"
    "class Point:\n    x: int\n    y: int\n"
    "class Vec:\n"
    "    def __init__(self, x):\n        self.x = x\n"
    "    def __add__(self, other):\n"
    "        return Vec(self.x + (other.x if isinstance(other, Vec) else other))\n"
    "    __radd__ = __add__\n"
    "    def __eq__(self, other):\n        return isinstance(other, Vec) and self.x == other.x\n"
    "    def __lt__(self, other):\n        return self.x < other.x\n"
    "class Plain:\n    pass\n"
)


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("assert Point(1, 2) == Point(1, 2)\n", id="a dataclass's =="),
        pytest.param("assert Point(1, 2) != Point(2, 1)\n", id="!="),
        pytest.param("assert Vec(1) + Vec(2) == Vec(3)\n", id="+ then =="),
        pytest.param("assert 1 + Vec(2) == Vec(3)\n", id="reflected +"),
        pytest.param("assert Vec(1) < Vec(2) and not Vec(2) < Vec(1)\n", id="<"),
        pytest.param("assert sorted([Vec(3), Vec(1)]) == [Vec(1), Vec(3)]\n", id="sorted"),
        pytest.param("p = Plain()\nassert p == p and Plain() != Plain()\n", id="no __eq__"),
        pytest.param("assert len({Point(1, 2).x, Vec(1).x}) == 1\n", id="attributes"),
        pytest.param(
            "try:\n    Plain() < Plain()\n    ok = False\n"
            "except TypeError:\n    ok = True\nassert ok\n",
            id="no __lt__",
        ),
    ],
)
async def test_the_tests_compare_and_add_objects_they_built_as_python_does(
    pool: SandboxPool, tests: str
) -> None:
    """Class-design tasks compare and combine the objects their tests build: their class's
    operators decide, as in one program (a right ``@dataclass`` scored 0 on ``==``)."""
    assert classic(_SHAPES, tests)
    assert (await judge(pool, _SHAPES, tests)).score() == 1.0


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("assert add(2, 3) == 5\n", id="=="),
        pytest.param("assert add(2, 3) >= 5 and add(2, 3) <= 5\n", id="<= and >="),
        pytest.param("assert add(2, 3) + 1 == 6\n", id="+"),
        pytest.param("assert len(add(2, 3)) == 5\n", id="len"),
        pytest.param("assert str(add(2, 3)) == '5'\n", id="str"),
        pytest.param("assert 5 in add(2, 3)\n", id="in"),
    ],
)
async def test_a_class_named_as_the_function_the_tests_call_builds_no_trusted_object(
    pool: SandboxPool, tests: str
) -> None:
    """Without a prompt that declares the function, an answer can make it a class whose
    every operator says yes, and the tests' call of it builds one: the tests' trust in
    the objects they build from the answer's classes is for classes they name as
    classes (``Point``), not for ``add``, which they call for a value."""
    answer = (
        "class add:\n"
        "    def __init__(self, *a):\n        pass\n"
        "    def __eq__(self, other):\n        return True\n"
        "    __le__ = __ge__ = __contains__ = __eq__\n"
        "    def __add__(self, other):\n        return self\n"
        "    def __len__(self):\n        return 5\n"
        "    def __str__(self):\n        return '5'\n"
    )
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 0.0


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("assert abs(Area(2) - 12.566) < 0.01\n", id="-"),
        pytest.param("assert abs(12.566 - Area(2)) < 0.01\n", id="reflected -"),
        pytest.param("assert round(Area(2) / 12.566, 2) == 1\n", id="/"),
        pytest.param(
            "import unittest\n"
            "class T(unittest.TestCase):\n"
            "    def test_area(self):\n"
            "        self.assertAlmostEqual(Area(2), 12.566, places=2)\n"
            "unittest.main()\n",
            id="assertAlmostEqual",
        ),
    ],
)
async def test_arithmetic_with_a_value_gives_none_of_the_answers_values(
    pool: SandboxPool, tests: str
) -> None:
    """MBPP names functions like classes (``Area``), so the tests' call of a class of
    that name built an object whose arithmetic with their expected value was its own:
    ``__sub__`` returning 0 passed ``abs(Area(2) - 12.566) < 0.01`` and
    ``assertAlmostEqual`` (a hostile review; the classic recipe passes it too). Its
    comparison with a value was closed before; arithmetic with a value now gives only
    more of its objects, never a value of its choosing."""
    wrong = (
        "class Area:\n"
        "    def __init__(self, r):\n        pass\n"
        "    def __sub__(self, other):\n        return 0\n"
        "    __rsub__ = __sub__\n"
        "    def __truediv__(self, other):\n        return 1\n"
    )
    right = "def Area(r):\n    return 3.14159 * r * r\n"
    assert classic(right, tests)
    assert (await judge(pool, wrong, tests)).score() == 0.0
    assert (await judge(pool, right, tests)).score() == 1.0


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("assert callable(make_adder(1))\n", id="callable"),
        pytest.param(
            "import collections.abc\nassert isinstance(make_adder(1), collections.abc.Callable)\n",
            id="a Callable",
        ),
    ],
)
async def test_only_what_the_answer_can_call_can_be_called(pool: SandboxPool, tests: str) -> None:
    """A stand-in that could always be called passed ``callable(make_adder(1))`` for an
    answer returning ``object()`` (the re-attack of the attribute reads); a closure
    passes as in one program."""
    wrong = "def make_adder(n):\n    return object()\n"
    right = "def make_adder(n):\n    return lambda x: x + n\n"
    assert not classic(wrong, tests) and classic(right, tests)
    assert (await judge(pool, wrong, tests)).score() == 0.0
    assert (await judge(pool, right, tests)).score() == 1.0


async def test_the_method_mark_is_no_value_a_call_can_return(pool: SandboxPool) -> None:
    """The mark an attribute read answers for a method is one object: returned by every
    call (its process is forked from the harness's, which holds it), it made
    ``f(a) == f(b)`` true for any two answers."""
    answer = (
        "import sys\n"
        "_M = sys._getframe(1).f_globals['METHOD']\n"
        "def canon(xs):\n    return _M\n"
        "def pair(xs):\n    return [_M, _M]\n"
    )
    tests = (
        "assert canon([3, 1, 2]) == canon([1, 2, 3])\n"
        "assert canon([2, 2, 1]) == canon([1, 2, 2])\n"
        "assert pair([1]) == pair([2])\n"
    )
    assert (await judge(pool, answer, tests)).passed == 0


async def test_an_attribute_the_tests_set_reaches_the_answer(pool: SandboxPool) -> None:
    answer = (
        "class Account:\n"
        "    def __init__(self, balance):\n        self.balance = balance\n"
        "    def deposit(self, n):\n        self.balance += n\n        return self.balance\n"
    )
    tests = "a = Account(100)\na.balance = 0\nassert a.deposit(5) == 5\nassert a.balance == 5\n"
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 1.0


async def test_a_builtin_bound_inside_a_test_case_plans_the_tests_again(
    pool: SandboxPool,
) -> None:
    """``unittest`` catches everything a test method raises, the harness's signal to plan
    the tests again included: the test was kept as failed, and a right answer scored 0."""
    answer = "def setup():\n    global max\n    max = lambda xs: sorted(xs)[-1]\n"
    tests = (
        "import unittest\n"
        "class T(unittest.TestCase):\n"
        "    def test_max(self):\n"
        "        setup()\n"
        "        self.assertEqual(max([1, 3, 2]), 3)\n"
        "unittest.main()\n"
    )
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 1.0


_YES = (
    "class _Yes:\n"
    "    def __init__(self, *a, **k):\n        pass\n"
    "    def __eq__(self, other):\n        return True\n"
    "    def __ne__(self, other):\n        return False\n"
    "    def __bool__(self):\n        return True\n"
    "    __hash__ = object.__hash__\n"
)
# MBPP task 629's function is named ``Split``, as a class would be.
_SPLIT_TESTS = [
    "assert Split([1,2,3,4,5]) == [2,4]",
    "assert Split([4,5,6,7,8,0,1]) == [4,6,8,0]",
    "assert Split ([8,12,15,19]) == [8,12]",
]


@pytest.mark.parametrize(
    "label",
    [
        pytest.param(_SPLIT_TESTS, id="test_list"),
        pytest.param({"test_list": _SPLIT_TESTS}, id="mapping"),
        pytest.param(
            {
                "test": "def check(candidate):\n"
                "    assert candidate([1,2,3,4,5]) == [2,4]\n"
                "    assert candidate([8,12,15,19]) == [8,12]\n",
                "entry_point": "Split",
            },
            id="entry point, no prompt",
        ),
        pytest.param(
            "import unittest\n"
            "class T(unittest.TestCase):\n"
            "    def test_split(self):\n"
            "        self.assertEqual(Split([1,2,3,4,5]), [2,4])\n"
            "unittest.main()\n",
            id="unittest",
        ),
        pytest.param(
            "assert Find_Max([[1],[1,2]]) == [1,2]\nassert Diff([10,15], [25]) == [10,15,25]\n",
            id="other names",
        ),
    ],
)
async def test_a_function_named_like_a_class_compares_as_a_value(
    pool: SandboxPool, label: object
) -> None:
    """MBPP names functions ``Split``, ``Find_Max``, ``Diff``: the answer can make them
    classes whose ``==`` says yes, and the tests' own call builds the object. A built
    object's comparison is trusted only against another of the answer's objects, never
    against a value (a second re-attack: every form of these tests scored 1.0)."""
    answer = _YES + "".join(f"class {n}(_Yes):\n    pass\n" for n in ("Split", "Find_Max", "Diff"))
    assert classic(answer, "\n".join(_SPLIT_TESTS))
    assert (await judge(pool, answer, label)).score() == 0.0
    right = "def Split(xs):\n    return [x for x in xs if x % 2 == 0]\n"
    assert (await judge(pool, right, _SPLIT_TESTS)).score() == 1.0


async def test_a_built_objects_comparison_is_its_own_classs(pool: SandboxPool) -> None:
    """``midpoint(a, b) == Point(1, 1)``: the tests trust ``Point``'s ``==``, but Python
    asks the left side first, an object the answer returned that says yes to anything."""
    answer = (
        _YES
        + "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        + "    def __eq__(self, o):\n"
        + "        return isinstance(o, Point) and (self.x, self.y) == (o.x, o.y)\n"
        + "def midpoint(a, b):\n    return _Yes()\n"
    )
    tests = (
        "assert midpoint(Point(0, 0), Point(2, 2)) == Point(1, 1)\n"
        "assert not midpoint(Point(0, 0), Point(2, 2)) != Point(1, 1)\n"
    )
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).passed == 0


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(
            "class Bag:\n"
            "    def __setattr__(self, k, v):\n        v.clear()\n"
            "    def total(self):\n        return 0\n",
            "xs = [3, 1, 2]\nb = Bag()\nb.items = xs\nassert b.total() == sum(xs)\n",
            id="a list emptied",
        ),
        pytest.param(
            "class Config:\n"
            "    def __setattr__(self, k, v):\n        v.clear(); v['a'] = 0\n"
            "    def get(self, k):\n        return 0\n",
            "want = {'a': 7}\nc = Config()\nc.values = want\nassert c.get('a') == want['a']\n",
            id="a dict rewritten",
        ),
    ],
)
async def test_an_attribute_the_tests_set_changes_nothing_of_theirs(
    pool: SandboxPool, answer: str, tests: str
) -> None:
    """Setting an attribute is a call that returns ``None``, whose changes to its
    arguments were copied back to the tests: the answer emptied what they computed the
    expected value from."""
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 0.0


_FORGED = (
    "class Yes:\n"
    "    def __eq__(self, other):\n        return True\n"
    "    __lt__ = __le__ = __gt__ = __ge__ = __eq__\n"
    "    def __ne__(self, other):\n        return False\n"
    "    def __add__(self, other):\n        return self\n"
    "    __radd__ = __add__\n"
    "def f(x):\n    return Yes()\n"
    "def g(x):\n    return Yes()\n"
)


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("assert f(1) == 2\n", id="== a value"),
        pytest.param("assert 2 == f(1)\n", id="a value =="),
        pytest.param("assert f(1) == g(2)\n", id="== another answer"),
        pytest.param("assert not f(1) != 2\n", id="!="),
        pytest.param("assert f(1) <= 2 and f(1) >= 2\n", id="<= and >="),
        pytest.param("assert f(1) + 1 == 2\n", id="+ then =="),
        pytest.param("assert 1 + f(1) == 2\n", id="reflected + then =="),
        pytest.param("assert f(1) in [2]\n", id="in a list"),
        pytest.param("assert [f(1)] == [2]\n", id="in a list =="),
        pytest.param("assert f(1).__eq__(2)\n", id="__eq__ called"),
        pytest.param("assert not f(1).__ne__(2)\n", id="__ne__ called"),
    ],
)
async def test_operators_on_objects_the_answer_returned_forge_nothing(
    pool: SandboxPool, tests: str
) -> None:
    """An object whose every comparison says yes, returned where a value was expected:
    it passes all of these as one program; its operators are asked only where the
    tests built one of the two objects from the answer's class."""
    assert classic(_FORGED, tests)
    assert (await judge(pool, _FORGED, tests)).score() == 0.0


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("assert make().real == 3\n", id="a value's attribute"),
        pytest.param("assert make().startswith('x')\n", id="a value's method"),
        pytest.param("assert make().me.real == 3\n", id="through itself"),
        pytest.param("assert make().me.startswith('x')\n", id="a value's method, through"),
        pytest.param("assert make().items == [3]\n", id="a dict's method as data"),
    ],
)
async def test_an_attribute_read_forges_no_value(pool: SandboxPool, tests: str) -> None:
    """A returned object whose every attribute and call says yes: reading an attribute
    asks the answer's process for it, which may answer anything, so a value's own names
    (``real``, ``startswith``) stay refused on an object the tests did not build, and an
    attribute that is the object itself reads as one of its methods."""
    answer = (
        "class Yes:\n"
        "    real = 3\n"
        "    items = [3]\n"
        "    def startswith(self, *a):\n        return True\n"
        "    @property\n"
        "    def me(self):\n        return self\n"
        "    def __eq__(self, other):\n        return True\n"
        "def make():\n    return Yes()\n"
    )
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 0.0


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param("assert len(make()) == 3\n", id="len"),
        pytest.param("assert 3 in make()\n", id="in"),
        pytest.param("assert make()[0] == 3\n", id="index"),
        pytest.param("assert str(make()) == '3'\n", id="str"),
        pytest.param("assert list(make()) == [3]\n", id="iter"),
        pytest.param("assert make() == 3\n", id="eq"),
    ],
)
async def test_a_returned_object_answers_no_protocol_for_the_value_it_stands_for(
    pool: SandboxPool, tests: str
) -> None:
    """Where the tests expected a value, the answer's object must not pass for it: its
    protocols (an object whose every answer is the expected one) are refused there, as
    its methods named like a value's are. Its truth is its own (one bit the answer could
    return as data): ``tests/test_reward_calls.py``."""
    liar = (
        "class Liar:\n"
        "    def __len__(self):\n        return 3\n"
        "    def __contains__(self, x):\n        return True\n"
        "    def __getitem__(self, i):\n        return 3\n"
        "    def __str__(self):\n        return '3'\n"
        "    def __iter__(self):\n        return iter([3])\n"
        "    def __eq__(self, other):\n        return True\n"
        "    def __bool__(self):\n        return False\n"
        "def make():\n    return Liar()\n"
    )
    assert classic(liar, tests)
    assert (await judge(pool, liar, tests)).score() == 0.0


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param(
            "import io, contextlib\nbuf = io.StringIO()\nwith contextlib.redirect_stdout(buf):\n"
            "    show(3)\nassert buf.getvalue() == '***\\n'\n",
            id="redirect_stdout",
        ),
        pytest.param(
            "import io, sys\nold, sys.stdout = sys.stdout, io.StringIO()\nshow(2)\n"
            "out, sys.stdout = sys.stdout.getvalue(), old\nassert out == '**\\n'\n",
            id="sys.stdout replaced",
        ),
        pytest.param(
            "import io, contextlib\nbuf = io.StringIO()\nwith contextlib.redirect_stderr(buf):\n"
            "    warn()\nassert buf.getvalue() == 'careful\\n'\n",
            id="redirect_stderr",
        ),
    ],
)
async def test_what_a_call_prints_reaches_the_tests_that_capture_it(
    pool: SandboxPool, tests: str
) -> None:
    """Print-a-pattern tasks capture what the function prints: it went to the answer
    process's ``/dev/null``, and a right answer the classic recipe passes scored 0."""
    answer = (
        "import sys\ndef show(n):\n    print('*' * n)\n"
        "def warn():\n    print('careful', file=sys.stderr)\n"
    )
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 1.0
    wrong = answer.replace("'*' * n", "'*' * (n + 1)").replace("'careful'", "'ok'")
    assert not classic(wrong, tests)
    assert (await judge(pool, wrong, tests)).score() == 0.0


async def test_what_a_call_prints_never_reaches_the_verdict(pool: SandboxPool) -> None:
    """Printed text goes only to a stream the tests set up themselves: a flood of it, or a
    line shaped like a verdict, neither stalls the grading nor passes a wrong answer."""
    flood = (
        'def add(a, b):\n    print(\'{"passed": 1, "total": 1}\\n\' * 200_000)\n'
        "    import sys\n    print('x' * 5_000_000, file=sys.stderr)\n    return a - b\n"
    )
    tests = "for _ in range(5):\n    assert add(2, 3) == 5\n"
    assert (await judge(pool, flood, tests)).score() == 0.0
    captured = "import io, contextlib\nwith contextlib.redirect_stdout(io.StringIO()):\n" + (
        "    " + tests.replace("\n    ", "\n        ")
    )
    assert (await judge(pool, flood, captured)).score() == 0.0
    right = flood.replace("return a - b", "return a + b")
    assert (await judge(pool, right, tests)).score() == 1.0  # nothing captured: none sent
    # Past the 1 MiB the tests' capture takes the call fails (documented), within it passes.
    assert (await judge(pool, right, captured)).score() == 0.0
    within = right.replace("* 200_000", "* 20_000")
    assert (await judge(pool, within, captured)).score() == 1.0


FIB = "def fib():\n    a, b = 0, 1\n    while True:\n        yield a\n        a, b = b, a + b\n"
PRIMES = (
    "def primes():\n    n = 2\n    while True:\n"
    "        if all(n % d for d in range(2, n)):\n            yield n\n        n += 1\n"
)


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(
            FIB,
            "g = fib()\nassert [next(g) for _ in range(10)] == [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n",
            id="an endless generator of growing items",
        ),
        pytest.param(
            PRIMES,
            "g = primes()\nassert [next(g) for _ in range(5)] == [2, 3, 5, 7, 11]\n",
            id="an endless generator of costly items",
        ),
        pytest.param(
            "import itertools\ndef evens():\n"
            "    return filter(lambda n: n % 2 == 0, itertools.count())\n",
            "import itertools\nassert list(itertools.islice(evens(), 3)) == [0, 2, 4]\n",
            id="an endless filter",
        ),
        pytest.param(
            "def pairs(n):\n    return ((i, iter(range(i))) for i in range(n))\n",
            "assert [(i, list(r)) for i, r in pairs(3)] == [(0, []), (1, [0]), (2, [0, 1])]\n",
            id="iterators inside an iterator",
        ),
        pytest.param(
            "def count(n):\n    yield from range(n)\n",
            "assert list(count(5000)) == list(range(5000))\nassert sum(count(10)) == 45\n"
            "g = count(1)\nassert next(g) == 0\ntry:\n    next(g)\n    ended = False\n"
            "except StopIteration:\n    ended = True\nassert ended\n",
            id="a finite generator, to its end and past it",
        ),
        pytest.param(
            "def risky():\n    yield 1\n    yield 2\n    raise ValueError('third')\n",
            "g = risky()\nassert next(g) == 1 and next(g) == 2\ntry:\n    next(g)\n"
            "    raised = False\nexcept ValueError as e:\n    raised = str(e) == 'third'\n"
            "assert raised\n",
            id="items, then what the generator raised",
        ),
    ],
)
async def test_a_returned_iterator_gives_its_items_as_the_tests_ask(
    pool: SandboxPool, answer: str, tests: str
) -> None:
    """Its items were all taken when the call returned (up to 100,000): an endless
    generator of growing or costly items failed its call, where the classic recipe takes
    the ten the tests ask for. They are now taken as the tests ask."""
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 1.0


async def test_an_iterator_cannot_pass_for_a_value_or_end_the_tests_early(
    pool: SandboxPool,
) -> None:
    """Its end is its own, as in one program: it never stops the tests' own loop, and it
    equals no list."""
    liar = "def evens(n):\n    return iter([0, 2, 4])\n"
    assert (await judge(pool, liar, "assert evens(3) == [0, 2, 4]\n")).score() == 0.0
    short = "def evens(n):\n    yield 0\n"
    tests = "assert list(evens(3)) == [0, 2, 4]\n"
    assert not classic(short, tests)
    assert (await judge(pool, short, tests)).score() == 0.0
    stops = "def is_even(n):\n    raise StopIteration\n"
    assert (await judge(pool, stops, "assert all(map(is_even, [1, 3]))\n")).score() == 0.0


async def test_a_round_the_answer_starts_over_is_no_retry(pool: SandboxPool) -> None:
    """A re-attack of the rounds above: the tests start over when the answer binds a
    builtin they use, and a round's results were forgotten. A wrong answer guessed, noted
    in a file where ``check`` stopped (a call with no successor was answered wrong), bound
    one more builtin to start over, and scored 1.0 (the classic recipe runs it once: 0).
    A test now passes only where it passed every time it ran."""
    label = {"test": ORACLE_TESTS, "entry_point": "secret_bit"}
    assert not classic(ORACLE + "\n" + ORACLE_TESTS, "check(secret_bit)\n")
    assert (await judge(pool, ORACLE, label, timeout=20.0)).score() == 0.0


async def test_what_the_second_reading_shows_is_not_replayed_in_a_new_round(
    pool: SandboxPool,
) -> None:
    """In the second reading a contested builtin is the answer's, so the tests'
    ``sorted(expected)`` hands it what they expect, as the classic recipe does. It then
    bound ``len`` to start the tests over and answered the new round from that table: a
    ``common`` that computes nothing scored 4 of 4 (the classic recipe passes 1)."""
    assert not classic(LEAK, LEAK_TESTS)
    verdict = await judge(pool, LEAK, LEAK_TESTS, timeout=20.0)
    assert verdict.passed <= 1, verdict


_LEAKING_STACK = (
    "class Stack:\n"
    "    def __init__(self):\n        self._items = []\n"
    "    def push(self, x):\n        self._items.append(x)\n"
    "    def items(self):\n        return self._items\n"
    "    def size(self):\n        return len(self._items)\n"
)


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param(
            "s = Stack()\nxs = s.items()\nxs.append(xs)\ns.push(1)\nassert s.size() >= 1\n"
            "assert s.items() is not None\n",
            id="a cycle the tests make in a value they share",
        ),
        pytest.param(
            "s = Stack()\nxs = s.items()\nxs.extend(range(3_000_000))\ns.push(1)\n"
            "assert s.items()[-1] == 1\nassert s.size() >= 1\n",
            id="a value the tests grow past what is carried",
        ),
        pytest.param(
            "s = Stack()\nxs = s.items()\nxs.append('x' * 5_000_000)\ns.push(1)\n"
            "assert s.items()[-1] == 1\nassert s.size() >= 1\n",
            id="a string too long to carry in a value the tests share",
        ),
    ],
)
async def test_a_shared_value_past_what_is_carried_fails_nothing_else(
    pool: SandboxPool, tests: str
) -> None:
    """The tests' changes to a value they share with the answer are carried to it before
    its next call, up to a bound: past it (a cycle, more than a MiB of text) the value is
    no longer shared, as before, and neither the harness nor the next call fails for
    it, nor does it wait on the value's size."""
    assert classic(_LEAKING_STACK, tests)
    verdict = await judge(pool, _LEAKING_STACK, tests, timeout=20.0, case_timeout=10.0)
    assert verdict.judged and verdict.total == 2
    assert verdict.passed == 2, verdict
