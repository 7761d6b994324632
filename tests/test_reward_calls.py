"""What a call carries between the tests and the answer's process, re-attacked: prints,
a returned iterator's items, an object's truth and its slices.

A hostile review of the fixes that made prints reach the tests, iterators lazy and built
objects answer Python's protocols proved each case below on that code: a wrong answer
scoring more than the classic recipe (stdout and stderr replayed out of order, a
generator's prints taken ahead into the tests' capture, output past the cap cut into a
pass, a returned empty container read as true) or a right one scoring 0 (a generator run
ahead of the tests, a slice that could not travel, prints nobody captured overfilling the
reply, ``sys.stdout.buffer`` missing, an iterator without ``__iter__``).
"""

from __future__ import annotations

import time

import pytest
from _grading import anyio_backend, classic, judge, pool, wrong_scores  # noqa: F401 (fixtures)

from tangram._sandbox._pool import SandboxPool

pytestmark = pytest.mark.anyio


# 1. stdout and stderr captured into one buffer: the harness writes a call's whole stdout,
#    then its whole stderr, so the order the answer printed them in is lost.
ORDER_TESTS = (
    "import io, contextlib\n"
    "buf = io.StringIO()\n"
    "with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):\n"
    "    report()\n"
    "assert buf.getvalue() == 'result: 1\\nwarning: done\\n', buf.getvalue()\n"
)
WRONG_ORDER = (
    "import sys\n"
    "def report():\n"
    "    print('warning: done', file=sys.stderr)\n"
    "    print('result: 1')\n"
)


async def test_stdout_and_stderr_captured_together_keep_their_order(pool: SandboxPool) -> None:
    assert not classic(WRONG_ORDER, ORDER_TESTS)
    assert (await judge(pool, WRONG_ORDER, ORDER_TESTS)).score() == 0.0


# 2. Read-ahead: the harness takes 1, 2, 4 ... items a call, so what the generator prints
#    (or does) for an item the tests have not asked for yet lands in the current capture.
LAG_TESTS = (
    "import io, contextlib\n"
    "g = steps()\n"
    "buf = io.StringIO()\n"
    "with contextlib.redirect_stdout(buf):\n"
    "    assert next(g) == 1\n"
    "    assert next(g) == 2\n"
    "assert buf.getvalue() == 'step 1\\nstep 2\\n', buf.getvalue()\n"
)
# Wrong: each step's message is printed one item late.
LAGGING = (
    "def steps():\n"
    "    print('step 1')\n"
    "    yield 1\n"
    "    yield 2\n"
    "    print('step 2')\n"
    "    yield 3\n"
)


async def test_what_a_generator_prints_ahead_of_the_tests_does_not_reach_their_capture(
    pool: SandboxPool,
) -> None:
    assert not classic(LAGGING, LAG_TESTS)
    assert (await judge(pool, LAGGING, LAG_TESTS)).score() == 0.0


# 2b. The same read-ahead costs a right answer: the generator's side effect for item 3
#     happens before the tests asked for it.
READ_AHEAD_STATE_TESTS = (
    "q = Queue()\n"
    "for i in range(5):\n"
    "    q.put(i)\n"
    "g = q.drain()\n"
    "assert next(g) == 0\n"
    "assert next(g) == 1\n"
    "assert q.size() == 3\n"
)
RIGHT_QUEUE = (
    "class Queue:\n"
    "    def __init__(self):\n"
    "        self.items = []\n"
    "    def put(self, x):\n"
    "        self.items.append(x)\n"
    "    def size(self):\n"
    "        return len(self.items)\n"
    "    def drain(self):\n"
    "        while self.items:\n"
    "            yield self.items.pop(0)\n"
)


async def test_a_generator_is_not_run_ahead_of_the_tests(pool: SandboxPool) -> None:
    assert classic(RIGHT_QUEUE, READ_AHEAD_STATE_TESTS)
    assert (await judge(pool, RIGHT_QUEUE, READ_AHEAD_STATE_TESTS)).score() == 1.0


# 3. An object the answer returned is always truthy: a wrong answer's empty container
#    passes `assert f(x)` where the classic recipe asks its class and fails.
FALSY = (
    "class Path:\n"
    "    def __init__(self, nodes):\n"
    "        self.nodes = nodes\n"
    "    def __len__(self):\n"
    "        return len(self.nodes)\n"
    "def find_path(a, b):\n"
    "    return Path([])  # wrong: no path found\n"
)
FALSY_TESTS = "assert find_path(1, 2)\n"


async def test_a_returned_object_is_as_truthy_as_its_class_says(pool: SandboxPool) -> None:
    assert not classic(FALSY, FALSY_TESTS)
    assert (await judge(pool, FALSY, FALSY_TESTS)).score() == 0.0


# 4. Each stream is cut at 1 MiB a call: trailing output past it is dropped, so a wrong
#    answer's extra output passes an exact comparison.
BIG = 1 << 20
TRUNC_TESTS = (
    "import io, contextlib\n"
    "buf = io.StringIO()\n"
    "with contextlib.redirect_stdout(buf):\n"
    "    dump()\n"
    f"assert buf.getvalue() == 'x' * {BIG}\n"
)
TRUNC = f"def dump():\n    print('x' * {BIG} + 'WRONG TRAILER')\n"


async def test_output_past_the_cap_is_not_dropped_into_a_pass(pool: SandboxPool) -> None:
    assert not classic(TRUNC, TRUNC_TESTS)
    assert (await judge(pool, TRUNC, TRUNC_TESTS, timeout=30.0, case_timeout=10.0)).score() == 0.0


# 5. Right answers that score 0 where the classic recipe passes them.
SLICE = (
    "class Seq:\n"
    "    def __init__(self, *xs):\n"
    "        self.xs = list(xs)\n"
    "    def __getitem__(self, i):\n"
    "        return self.xs[i]\n"
)
SLICE_TESTS = "s = Seq(1, 2, 3)\nassert s[0] == 1\nassert s[1:] == [2, 3]\n"


async def test_a_built_object_can_be_sliced(pool: SandboxPool) -> None:
    assert classic(SLICE, SLICE_TESTS)
    assert (await judge(pool, SLICE, SLICE_TESTS)).score() == 1.0


WIDE = (
    "import sys\n"
    "def f():\n"
    "    print('\\U0001F600' * 1_000_000)\n"
    "    print('\\U0001F600' * 1_000_000, file=sys.stderr)\n"
    "    return 1\n"
)
WIDE_TESTS = "assert f() == 1\n"


async def test_what_a_call_prints_never_fails_it(pool: SandboxPool) -> None:
    """Not captured by the tests at all, yet sent: 2 x 1M astral characters are 24 MB
    of JSON (\\ud83d\\ude00 each), past the 16 MiB reply limit."""
    assert classic(WIDE, WIDE_TESTS)
    assert (await judge(pool, WIDE, WIDE_TESTS, timeout=30.0, case_timeout=10.0)).score() == 1.0


BUFFER = "import sys\ndef f():\n    sys.stdout.buffer.write(b'hi\\n')\n    return 1\n"


async def test_a_call_may_write_to_stdouts_buffer(pool: SandboxPool) -> None:
    assert classic(BUFFER, WIDE_TESTS)
    assert (await judge(pool, BUFFER, WIDE_TESTS)).score() == 1.0


NEXT_ONLY = (
    "class It:\n"
    "    def __init__(self):\n"
    "        self.i = 0\n"
    "    def __next__(self):\n"
    "        self.i += 1\n"
    "        if self.i > 3:\n"
    "            raise StopIteration\n"
    "        return self.i\n"
    "class Bag:\n"
    "    def __iter__(self):\n"
    "        return It()\n"
)
NEXT_ONLY_TESTS = "assert list(Bag()) == [1, 2, 3]\n"


async def test_a_built_objects_iterator_without_iter_is_iterated(pool: SandboxPool) -> None:
    assert classic(NEXT_ONLY, NEXT_ONLY_TESTS)
    assert (await judge(pool, NEXT_ONLY, NEXT_ONLY_TESTS)).score() == 1.0


DEFAULTS = {"timeout": 60.0, "case_timeout": 10.0}  # tangram's own defaults (_grade.py)


# A third re-attack. An object with ``__next__`` is sent as ``Lazy`` (_fork.py _plain, the last
#    branch, now without the ``__iter__`` requirement) and becomes ``Items``, which has no
#    ``__bool__``/``__len__``: always true. The answer's class says it is empty (len 0),
#    so ``assert f(x)`` fails in one program and passes here: the FALSY hack that
#    2c5a6c5 closed for Remote, reopened by adding a ``__next__`` to the class.
FALSY_ITER = (
    "class Path:\n"
    "    def __init__(self, nodes):\n"
    "        self.nodes = list(nodes)\n"
    "    def __len__(self):\n"
    "        return len(self.nodes)\n"
    "    def __next__(self):\n"
    "        if not self.nodes:\n"
    "            raise StopIteration\n"
    "        return self.nodes.pop(0)\n"
    "def find_path(a, b):\n"
    "    return Path([])  # wrong: no path found\n"
)
FALSY_TESTS = "assert find_path(1, 2)\n"


async def test_an_empty_iterator_object_is_not_read_as_true(pool: SandboxPool) -> None:
    assert not classic(FALSY_ITER, FALSY_TESTS)
    assert (await judge(pool, FALSY_ITER, FALSY_TESTS)).score() == 0.0


# _Printed.add merges a run with ``self.log[-1][1] += text``: the
#    string is held by the list during the concatenation, so CPython cannot grow it in
#    place and copies it every write: quadratic. A print-a-pattern answer writing 490,000
#    single characters (480 KiB, under the 1 MiB cap) takes ~35 s in the answer's process
#    (measured: 200k writes 4.5 s, 300k 14 s, 500k 36 s), past the default 10 s case
#    timeout; the classic recipe's StringIO takes ~0.2 s.
GRID = (
    "def grid(n):\n"
    "    for i in range(n):\n"
    "        for j in range(n):\n"
    "            print('#' if (i + j) % 2 else '.', end='')\n"
    "        print()\n"
)
GRID_TESTS = (
    "import io, contextlib\n"
    "buf = io.StringIO()\n"
    "with contextlib.redirect_stdout(buf):\n"
    "    grid(700)\n"
    "rows = buf.getvalue().split('\\n')\n"
    "assert len(rows) == 701 and rows[0][:4] == '.#.#', rows[0][:4]\n"
)


async def test_a_pattern_printed_char_by_char_is_not_quadratic(pool: SandboxPool) -> None:
    start = time.monotonic()
    assert classic(GRID, GRID_TESTS)
    assert time.monotonic() - start < 5
    assert (await judge(pool, GRID, GRID_TESTS, **DEFAULTS)).score() == 1.0


# _Record.write accepts only ``type(text) is str``; StringIO (what
#    the tests capture into) accepts any str subclass: an ``Enum`` with a str mixin, a
#    ``numpy.str_``, a markup string. A right answer writing one fails its call.
SUBSTR = (
    "import sys, enum\n"
    "class Color(str, enum.Enum):\n"
    "    RED = 'red'\n"
    "def show():\n"
    "    sys.stdout.write(Color.RED)\n"
    "    sys.stdout.write('\\n')\n"
)
CAPTURE_TESTS = (
    "import io, contextlib\n"
    "buf = io.StringIO()\n"
    "with contextlib.redirect_stdout(buf):\n"
    "    show()\n"
    "assert buf.getvalue() == 'red\\n', buf.getvalue()\n"
)


async def test_a_str_subclass_written_to_stdout_is_written(pool: SandboxPool) -> None:
    assert classic(SUBSTR, CAPTURE_TESTS)
    assert (await judge(pool, SUBSTR, CAPTURE_TESTS)).score() == 1.0


# _Record has write/flush/writable/isatty only; the StringIO the
#    tests capture into has writelines (and encoding, errors, closed, ...). A right answer
#    using ``sys.stdout.writelines`` raises AttributeError.
WRITELINES = "import sys\ndef show():\n    sys.stdout.writelines(['red', '\\n'])\n"


async def test_writelines_to_a_captured_stdout_works(pool: SandboxPool) -> None:
    assert classic(WRITELINES, CAPTURE_TESTS)
    assert (await judge(pool, WRITELINES, CAPTURE_TESTS)).score() == 1.0


# 12. The standard library's value types, each (tests, right answer, wrong answer). An
#     ``OrderedDict`` travelled as a dict, so a wrong order passed ``== OrderedDict(...)``
#     where the classic recipe compares orders; a ``Counter``, a ``defaultdict`` and a
#     ``deque`` lost their own methods, lookups and comparisons, a namedtuple its fields
#     (``cache_info().hits``), and a ``deque``, a ``Fraction`` or a ``Decimal`` could not
#     be passed at all: right answers scored 0.
STDLIB_VALUES = {
    "an OrderedDict's order": (
        "from collections import OrderedDict\n"
        "assert by_key({'b': 2, 'a': 1}) == OrderedDict([('a', 1), ('b', 2)])\n",
        "from collections import OrderedDict\n"
        "def by_key(d):\n    return OrderedDict(sorted(d.items()))\n",
        "from collections import OrderedDict\ndef by_key(d):\n    return OrderedDict(d)\n",
    ),
    "an OrderedDict nested in a list": (
        "from collections import OrderedDict\n"
        "assert rows() == [OrderedDict([('x', 1), ('y', 2)])]\n",
        "from collections import OrderedDict\n"
        "def rows():\n    return [OrderedDict([('x', 1), ('y', 2)])]\n",
        "from collections import OrderedDict\n"
        "def rows():\n    return [OrderedDict([('y', 2), ('x', 1)])]\n",
    ),
    "a Counter's most_common": (
        "assert tally('abca').most_common(1) == [('a', 2)]\n",
        "from collections import Counter\ndef tally(s):\n    return Counter(s)\n",
        "from collections import Counter\ndef tally(s):\n    return Counter(s[1:])\n",
    ),
    "a Counter's comparison, zero counts as missing": (
        "from collections import Counter\nassert spent('ab', 'b') == Counter({'a': 1})\n",
        "from collections import Counter\n"
        "def spent(s, t):\n"
        "    c = Counter(s)\n"
        "    for ch in t:\n"
        "        c[ch] -= 1\n"
        "    return c\n",
        "from collections import Counter\n"
        "def spent(s, t):\n"
        "    c = Counter(s)\n"
        "    for ch in t:\n"
        "        c[ch] += 1\n"
        "    return c\n",
    ),
    "a defaultdict's missing key": (
        "g = groups([1, 2, 3])\nassert g['odd'] == [1, 3]\nassert g['none'] == []\n",
        "from collections import defaultdict\n"
        "def groups(xs):\n"
        "    d = defaultdict(list)\n"
        "    for x in xs:\n"
        "        d['odd' if x % 2 else 'even'].append(x)\n"
        "    return d\n",
        "def groups(xs):\n"
        "    d = {}\n"
        "    for x in xs:\n"
        "        d.setdefault('odd' if x % 2 else 'even', []).append(x)\n"
        "    return d\n",
    ),
    "a deque passed and returned": (
        "from collections import deque\nassert turn(deque([1, 2, 3]), 1) == deque([3, 1, 2])\n",
        "def turn(d, n):\n    d.rotate(n)\n    return d\n",
        "def turn(d, n):\n    d.rotate(-n)\n    return d\n",
    ),
    "a deque changed in place": (
        "from collections import deque\n"
        "d = deque([1, 2, 3], maxlen=3)\n"
        "push(d, 4)\n"
        "assert d == deque([2, 3, 4]) and d.maxlen == 3\n",
        "def push(d, x):\n    d.append(x)\n",
        "def push(d, x):\n    d.appendleft(x)\n",
    ),
    "a Counter changed in place": (
        "from collections import Counter\n"
        "c = Counter('ab')\n"
        "bump(c, 'a')\n"
        "assert c == Counter('aab')\n",
        "def bump(c, k):\n    c[k] += 1\n",
        "def bump(c, k):\n    c[k] -= 1\n",
    ),
    "a namedtuple's fields": (
        "p = point()\nassert p.x == 1 and p == (1, 2) and repr(p) == 'P(x=1, y=2)'\n",
        "from collections import namedtuple\n"
        "P = namedtuple('P', 'x y')\n"
        "def point():\n    return P(1, 2)\n",
        "from collections import namedtuple\n"
        "P = namedtuple('P', 'x y')\n"
        "def point():\n    return P(2, 1)\n",
    ),
    "a namedtuple's fields named like a str's methods": (
        "b = book()\nassert b.title == 'Dune' and b.count == 2\n",
        "from collections import namedtuple\n"
        "Book = namedtuple('Book', 'title count')\n"
        "def book():\n    return Book('Dune', 2)\n",
        "from collections import namedtuple\n"
        "Book = namedtuple('Book', 'title count')\n"
        "def book():\n    return Book('Dune', 3)\n",
    ),
    "a typing.NamedTuple in a list": (
        "assert [p.y for p in points()] == [2, 4]\n",
        "from typing import NamedTuple\n"
        "class P(NamedTuple):\n    x: int\n    y: int\n"
        "def points():\n    return [P(1, 2), P(3, 4)]\n",
        "from typing import NamedTuple\n"
        "class P(NamedTuple):\n    y: int\n    x: int\n"
        "def points():\n    return [P(1, 2), P(3, 4)]\n",
    ),
    "lru_cache's cache_info": (
        "fib(10)\nassert fib.cache_info().hits == 8\n",
        "from functools import lru_cache\n"
        "@lru_cache(maxsize=None)\n"
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "from functools import lru_cache\n"
        "@lru_cache(maxsize=None)\n"
        "def fib(n):\n"
        "    a, b = 0, 1\n"
        "    for _ in range(n):\n"
        "        a, b = b, a + b\n"
        "    return a\n",
    ),
    "a date": (
        "from datetime import date\nassert next_day(date(2024, 2, 28)) == date(2024, 2, 29)\n",
        "from datetime import timedelta\ndef next_day(d):\n    return d + timedelta(days=1)\n",
        "from datetime import timedelta\ndef next_day(d):\n    return d + timedelta(days=2)\n",
    ),
    "a datetime and a timedelta": (
        "from datetime import datetime, timedelta\n"
        "a, b = datetime(2024, 1, 1, 12), datetime(2024, 1, 2, 13, 0, 0, 5)\n"
        "assert gap(a, b) == timedelta(days=1, hours=1, microseconds=5)\n",
        "def gap(a, b):\n    return b - a\n",
        "def gap(a, b):\n    return a - b\n",
    ),
    "an aware datetime": (
        "from datetime import datetime, timezone\n"
        "t = datetime(2024, 1, 1, 12, tzinfo=timezone.utc)\n"
        "assert shifted(t, 2).hour == 14 and shifted(t, 2) == t\n",
        "from datetime import timezone, timedelta\n"
        "def shifted(t, h):\n    return t.astimezone(timezone(timedelta(hours=h)))\n",
        "def shifted(t, h):\n    return t.replace(hour=t.hour + h)\n",
    ),
    "a time": (
        "from datetime import time\nassert later(time(9, 30), 45) == time(10, 15)\n",
        "def later(t, m):\n"
        "    total = t.hour * 60 + t.minute + m\n"
        "    return t.replace(hour=total // 60, minute=total % 60)\n",
        "def later(t, m):\n    return t.replace(minute=(t.minute + m) % 60)\n",
    ),
    "a Fraction": (
        "from fractions import Fraction\nassert half(Fraction(1, 3)) == Fraction(1, 6)\n",
        "def half(x):\n    return x / 2\n",
        "def half(x):\n    return x / 3\n",
    ),
    "a Decimal": (
        "from decimal import Decimal\n"
        "assert total([Decimal('0.1'), Decimal('0.2')]) == Decimal('0.3')\n",
        "def total(xs):\n    return sum(xs)\n",
        "def total(xs):\n    return float(sum(xs))\n",
    ),
}


@pytest.mark.parametrize("name", sorted(STDLIB_VALUES))
async def test_the_standard_librarys_values_keep_their_type(pool: SandboxPool, name: str) -> None:
    tests, right, wrong = STDLIB_VALUES[name]
    assert await wrong_scores(pool, tests, right, wrong) == 0.0


# 13. A namedtuple's field named like a value's method (``startswith``, ``count``) held the
#     answer's function, so a wrong answer's result said yes to ``f(x).startswith(...)``,
#     which the answer's other objects are refused (``Remote``, ``_VALUE_METHODS``).
FIELD_HACKS = {
    "startswith": (
        "from collections import namedtuple\n"
        "def _yes(*a, **k):\n    return True\n"
        "R = namedtuple('R', ['startswith', 'endswith'])\n"
        "def greet(name):\n    return R(_yes, _yes)\n",
        "assert greet('Bob').startswith('Hello')\nassert greet('Ann').endswith('Ann!')\n",
    ),
    "count": (
        "from collections import namedtuple\n"
        "R = namedtuple('R', ['count'])\n"
        "def digits(n):\n    return R(lambda x: 2)\n",
        "assert digits(1211).count(1) == 2\nassert digits(505).count(5) == 2\n",
    ),
    "index, nested in a list": (
        "from collections import namedtuple\n"
        "R = namedtuple('R', ['index', 'x'])\n"
        "def found(xs, v):\n    return [R(lambda *a: 1, 0)]\n",
        "assert found([5, 7], 7)[0].index(7) == 1\n",
    ),
}


@pytest.mark.parametrize("name", sorted(FIELD_HACKS))
async def test_a_namedtuple_field_cannot_answer_for_a_values_method(
    pool: SandboxPool, name: str
) -> None:
    answer, tests = FIELD_HACKS[name]
    assert (await judge(pool, answer, tests)).score() == 0.0


# 14. Changes to arguments: copied back only after a call that returned None (an answer
#     that emptied its argument and returned a value rewrote what ``f(xs) == sum(xs)``
#     compared it with), so a wrong answer that changed an argument the task says to
#     leave alone passed the tests' check that it is unchanged, after a value or a raise;
#     and a change to a keyword argument was never copied. Each (tests, right, wrong).
ARGUMENT_CHANGES = {
    "changed, then a value returned": (
        "xs = [3, 1, 2]\nassert sorted_copy(xs) == [1, 2, 3]\nassert xs == [3, 1, 2]\n",
        "def sorted_copy(xs):\n    return sorted(xs)\n",
        "def sorted_copy(xs):\n    xs.sort()\n    return xs\n",
    ),
    "changed, then raised": (
        "xs = [1, -2]\n"
        "try:\n    check_all(xs)\nexcept ValueError:\n    pass\n"
        "assert xs == [1, -2]\n",
        "def check_all(xs):\n"
        "    if any(x < 0 for x in xs):\n"
        "        raise ValueError('negative')\n",
        "def check_all(xs):\n    xs.clear()\n    raise ValueError('negative')\n",
    ),
    "a keyword argument changed in place": (
        "xs = [1, 2]\nscale(values=xs, k=3)\nassert xs == [3, 6]\n",
        "def scale(values, k):\n    for i in range(len(values)):\n        values[i] *= k\n",
        "def scale(values, k):\n    values = [v * k for v in values]\n",
    ),
    "a keyword argument changed, then a value returned": (
        "xs = [1, 3]\nassert largest(items=xs) == 3\nassert xs == [1, 3]\n",
        "def largest(items):\n    return max(items)\n",
        "def largest(items):\n    items.sort()\n    return items.pop()\n",
    ),
    "a list inside a tuple argument": (
        "p = ([3, 1, 2], [5])\nassert smallest(p) == 1\nassert p[0] == [3, 1, 2]\n",
        "def smallest(pair):\n    return min(pair[0])\n",
        "def smallest(pair):\n    pair[0].sort()\n    return pair[0][0]\n",
    ),
    "1 made True": (
        "xs = [1, 0]\nassert count_true(xs) == 1\nassert [type(x) for x in xs] == [int, int]\n",
        "def count_true(xs):\n    return sum(1 for x in xs if x)\n",
        "def count_true(xs):\n    xs[:] = [bool(x) for x in xs]\n    return sum(xs)\n",
    ),
    "an inner list the tests hold, emptied": (
        "m = [[1, 2], [3]]\nrow = m[0]\nclear_first(m)\nassert row == [] and m[0] is row\n",
        "def clear_first(m):\n    m[0].clear()\n",
        "def clear_first(m):\n    m[0] = []\n",
    ),
    "an inner list the tests hold, replaced": (
        "m = [[1, 2], [3]]\nrow = m[0]\nreset_first(m)\nassert row == [1, 2] and m[0] == []\n",
        "def reset_first(m):\n    m[0] = []\n",
        "def reset_first(m):\n    m[0].clear()\n",
    ),
    "changed by a generator as the tests take its items": (
        "data = [3, 1, 2]\nassert list(ascending(data)) == [1, 2, 3]\nassert data == [3, 1, 2]\n",
        "def ascending(xs):\n    yield from sorted(xs)\n",
        "def ascending(xs):\n    xs.sort()\n    yield from xs\n",
    ),
    "kept by an object and changed by a later call": (
        "data = [1, 2, 3]\nq = Queue(data)\nassert q.take() == 1\nassert data == [1, 2, 3]\n",
        "class Queue:\n    def __init__(self, items):\n        self.items = list(items)\n"
        "    def take(self):\n        return self.items.pop(0)\n",
        "class Queue:\n    def __init__(self, items):\n        self.items = items\n"
        "    def take(self):\n        return self.items.pop(0)\n",
    ),
    "kept by an object and written by a later call": (
        "out = []\nlog = Logger(out)\nlog.write('a')\nassert out == ['a']\n",
        "class Logger:\n    def __init__(self, out):\n        self.out = out\n"
        "    def write(self, line):\n        self.out.append(line)\n",
        "class Logger:\n    def __init__(self, out):\n        self.out = list(out)\n"
        "    def write(self, line):\n        self.out.append(line)\n",
    ),
    "a dict changed, then a value returned": (
        "d = {'a': 1}\nassert total(d) == 1\nassert d == {'a': 1}\n",
        "def total(d):\n    return sum(d.values())\n",
        "def total(d):\n    return d.pop('a')\n",
    ),
}


@pytest.mark.parametrize("name", sorted(ARGUMENT_CHANGES))
async def test_a_change_to_an_argument_reaches_the_tests_as_in_one_program(
    pool: SandboxPool, name: str
) -> None:
    tests, right, wrong = ARGUMENT_CHANGES[name]
    assert await wrong_scores(pool, tests, right, wrong) < 1.0


# 15. A result was a copy, built afresh: no part of it was another part, or the tests'
#     argument, as in one program. A wrong ``[[0] * n] * n`` (one row three times) passed
#     the tests' change of one cell, a shallow copy their change of an inner list, and
#     ``return xs`` their ``is not``. Each (tests, right, wrong).
ALIASES = {
    "one row, three times": (
        "g = grid(3)\ng[0][0] = 1\nassert g == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]\n",
        "def grid(n):\n    return [[0] * n for _ in range(n)]\n",
        "def grid(n):\n    return [[0] * n] * n\n",
    ),
    "one dict under two keys": (
        "d = defaults(['a', 'b'])\nd['a']['x'] = 1\nassert d['b'] == {}\n",
        "def defaults(keys):\n    return {k: {} for k in keys}\n",
        "def defaults(keys):\n    shared = {}\n    return {k: shared for k in keys}\n",
    ),
    "a shallow copy": (
        "a = [[1], [2]]\nb = deep_copy(a)\nb[0].append(9)\nassert a == [[1], [2]]\n",
        "def deep_copy(a):\n    return [list(x) for x in a]\n",
        "def deep_copy(a):\n    return list(a)\n",
    ),
    "the argument itself": (
        "a = [1, 2]\nb = copy_list(a)\nassert b == a and b is not a\n",
        "def copy_list(xs):\n    return list(xs)\n",
        "def copy_list(xs):\n    return xs\n",
    ),
    "a keyword argument's inner dict": (
        "cfg = {'db': {'port': 1}}\n"
        "out = merged(base=cfg, port=2)\n"
        "assert out['db']['port'] == 2 and cfg['db']['port'] == 1\n",
        "def merged(base, port):\n    return {**base, 'db': {**base['db'], 'port': port}}\n",
        "def merged(base, port):\n"
        "    out = dict(base)\n"
        "    out['db']['port'] = port\n"
        "    return out\n",
    ),
    "the argument, returned as itself": (
        "xs = [2, 1]\nassert chained(xs) is xs\nassert chained(xs) == [2, 1]\n",
        "def chained(xs):\n    return xs\n",
        "def chained(xs):\n    return list(xs)\n",
    ),
    "a nested argument, returned as itself": (
        "rows = [[1], [2]]\nout = same_rows(rows)\nassert out is rows and out[1] is rows[1]\n",
        "def same_rows(rows):\n    return rows\n",
        "def same_rows(rows):\n    return [list(row) for row in rows]\n",
    ),
    "one object, returned twice": (
        "c1 = make_counter()\nc2 = make_counter()\nassert c1 is not c2 and c1 != c2\n",
        "class Counter:\n    def __init__(self):\n        self.n = 0\n"
        "    def bump(self):\n        self.n += 1\n"
        "def make_counter():\n    return Counter()\n",
        "class Counter:\n    def __init__(self):\n        self.n = 0\n"
        "    def bump(self):\n        self.n += 1\n"
        "_one = Counter()\n"
        "def make_counter():\n    return _one\n",
    ),
    "a singleton": (
        "assert config() is config()\n",
        "class Config:\n    pass\n_one = Config()\ndef config():\n    return _one\n",
        "class Config:\n    pass\ndef config():\n    return Config()\n",
    ),
    "one list, positional and by keyword": (
        "a = [1, 2]\ndouble_into(a, out=a)\nassert a == [2, 4]\n",
        "def double_into(xs, out):\n    out[:] = [2 * x for x in xs]\n",
        "def double_into(xs, out):\n    out = [2 * x for x in xs]\n",
    ),
    "an inner list, among others": (
        "rows = [[1], [2]]\nfirst = pick(rows, 0)\nfirst.append(5)\nassert rows == [[1, 5], [2]]\n",
        "def pick(rows, i):\n    return rows[i]\n",
        "def pick(rows, i):\n    return list(rows[i])\n",
    ),
}


@pytest.mark.parametrize("name", sorted(ALIASES))
async def test_a_result_shares_what_it_shares_in_one_program(pool: SandboxPool, name: str) -> None:
    tests, right, wrong = ALIASES[name]
    assert await wrong_scores(pool, tests, right, wrong) < 1.0


async def test_a_fraction_too_large_to_reduce_fails_its_call_not_the_harness(
    pool: SandboxPool,
) -> None:
    """An answer's unreduced ``Fraction`` of millions of bits took the harness minutes to
    reduce, past every deadline, and no verdict came (a hostile re-review): it fails the
    call that returned it, and the tests after it run."""
    answer = (
        "import fractions, random\n"
        "def f():\n"
        "    r = random.Random(1)\n"
        "    q = fractions.Fraction.__new__(fractions.Fraction)\n"
        "    q._numerator = r.getrandbits(8_000_000) | 1\n"
        "    q._denominator = r.getrandbits(8_000_000) | 1\n"
        "    return q\n"
    )
    tests = "assert f() != 0\nassert 1 == 1\n"
    verdict = await judge(pool, answer, tests, timeout=20.0, case_timeout=10.0)
    assert verdict.judged and (verdict.passed, verdict.total) == (1, 2)


# 16. Values both sides hold, changed by the tests: a result the answer keeps too (its
#     getter leaks its state) was a copy, so the tests' change to it never reached the
#     answer, and a wrong answer passed the tests' check that its state was unchanged; and
#     a list the tests passed and the answer kept (``self.data = data``) did not see the
#     tests' later change, so a right answer reading it failed and a wrong one that was to
#     copy it passed. Each (tests, right, wrong); the classic recipe tells them apart.
def _holder(name: str, made: str, returned: str) -> str:
    return (
        "import collections, copy\n"
        f"class {name}:\n"
        f"    def __init__(self):\n        self._v = {made}\n"
        f"    def get(self):\n        return {returned}\n"
        "    def size(self):\n        return len(self._v)\n"
    )


_STACK = (
    "class Stack:\n"
    "    def __init__(self):\n        self._items = []\n"
    "    def push(self, x):\n        self._items.append(x)\n"
    "    def items(self):\n        return %s\n"
)
_SIZE = "    def size(self):\n        return len(self._items)\n"
_ACC = (
    "class Acc:\n"
    "    def __init__(self, data):\n        self.data = %s\n"
    "    def add(self, x):\n        self.data.append(x)\n"
    "    def total(self):\n        return sum(self.data)\n"
)
_DECK = (
    "from collections import namedtuple\nCard = namedtuple('Card', 'rank suit')\n"
    "class Deck:\n    def __init__(self):\n"
    "        self._cards = [Card(r, s) for s in 'SHDC' for r in range(1, 14)]\n"
    "    def cards(self):\n        return %s\n"
    "    def size(self):\n        return len(self._cards)\n"
)
_BIG = (
    "class Stack:\n    def __init__(self):\n        self._items = []\n"
    "    def push(self, x):\n        self._items.append(x)\n        return ('x' * (1 << 20), [])\n"
    "    def size(self):\n        return len(self._items)\n"
    "    def items(self):\n        return %s\n"
)
_DB = (
    "from collections import namedtuple\nRec = namedtuple('Rec', 'k v')\n"
    "class Db:\n    def __init__(self):\n        self._rows = []\n"
    "    def add(self, k, v):\n        self._rows.append(Rec(k, v))\n"
    "    def rows(self):\n        return self._rows\n"
)
_BAG = (
    "class Bag:\n"
    "    def __init__(self):\n        self._xs = []\n"
    "    @property\n    def items(self):\n        return list(self._xs)\n"
    "    @items.setter\n    def items(self, v):\n        self._xs = %s\n"
)
_TOTAL = (
    "class Total:\n"
    "    def __init__(self, data):\n        self.data = %s\n"
    "    def total(self):\n        return sum(self.data)\n"
)
SHARED_CHANGES = {
    "a getter that leaks its list": (
        "s = Stack()\ns.push(1)\nxs = s.items()\nxs.append(99)\nassert s.items() == [1]\n",
        _STACK % "list(self._items)",
        _STACK % "self._items",
    ),
    "a getter that leaks its dict": (
        "c = Config()\nc.set('a', 1)\nd = c.as_dict()\nd['b'] = 2\nassert c.get('b') is None\n",
        "class Config:\n    def __init__(self):\n        self._d = {}\n"
        "    def set(self, k, v):\n        self._d[k] = v\n"
        "    def get(self, k):\n        return self._d.get(k)\n"
        "    def as_dict(self):\n        return dict(self._d)\n",
        "class Config:\n    def __init__(self):\n        self._d = {}\n"
        "    def set(self, k, v):\n        self._d[k] = v\n"
        "    def get(self, k):\n        return self._d.get(k)\n"
        "    def as_dict(self):\n        return self._d\n",
    ),
    "a shallow copy of nested rows": (
        "g = Grid(2)\nrows = g.rows()\nrows[0][0] = 5\nassert g.cell(0, 0) == 0\n",
        "class Grid:\n    def __init__(self, n):\n"
        "        self._rows = [[0] * n for _ in range(n)]\n"
        "    def rows(self):\n        return [list(r) for r in self._rows]\n"
        "    def cell(self, i, j):\n        return self._rows[i][j]\n",
        "class Grid:\n    def __init__(self, n):\n"
        "        self._rows = [[0] * n for _ in range(n)]\n"
        "    def rows(self):\n        return list(self._rows)\n"
        "    def cell(self, i, j):\n        return self._rows[i][j]\n",
    ),
    "an inner row taken out, then changed": (
        "g = Grid(2)\nrows = g.rows()\nrow = rows.pop()\nrow.append(7)\nassert g.width(1) == 2\n",
        "class Grid:\n    def __init__(self, n):\n"
        "        self._rows = [[0] * n for _ in range(n)]\n"
        "    def rows(self):\n        return [list(r) for r in self._rows]\n"
        "    def width(self, i):\n        return len(self._rows[i])\n",
        "class Grid:\n    def __init__(self, n):\n"
        "        self._rows = [[0] * n for _ in range(n)]\n"
        "    def rows(self):\n        return list(self._rows)\n"
        "    def width(self, i):\n        return len(self._rows[i])\n",
    ),
    "a list the answer keeps, changed by the tests": (
        "d = [1, 2]\na = Total(d)\nd.append(5)\nassert a.total() == 8\n",
        _TOTAL % "data",
        _TOTAL % "list(data)",
    ),
    "a list the answer must copy, changed by the tests": (
        "d = [1, 2]\na = Total(d)\nd.append(5)\nassert a.total() == 3\n",
        _TOTAL % "list(data)",
        _TOTAL % "data",
    ),
    "a list inside a dict the answer keeps": (
        "cfg = {'ports': [1]}\ns = Server(cfg)\ncfg['ports'].append(2)\nassert s.count() == 2\n",
        "class Server:\n    def __init__(self, cfg):\n        self.cfg = cfg\n"
        "    def count(self):\n        return len(self.cfg['ports'])\n",
        "import copy\nclass Server:\n    def __init__(self, cfg):\n"
        "        self.cfg = copy.deepcopy(cfg)\n"
        "    def count(self):\n        return len(self.cfg['ports'])\n",
    ),
    "a list the answer keeps, by keyword": (
        "d = [1]\na = Total(data=d)\nd[0] = 4\nassert a.total() == 4\n",
        _TOTAL % "data",
        _TOTAL % "data[:]",
    ),
    "a list set as an attribute, then changed": (
        "a = Total([])\nd = [1]\na.data = d\nd.append(2)\nassert a.total() == 3\n",
        _TOTAL % "data",
        "class Total:\n    def __init__(self, data):\n        self.data = data\n"
        "    def __setattr__(self, k, v):\n        object.__setattr__(self, k, list(v))\n"
        "    def total(self):\n        return sum(self.data)\n",
    ),
    **{
        f"a leaked {kind}": (
            f"b = Box()\nv = b.get()\n{change}\nassert b.size() == {size}\n",
            _holder("Box", made, "copy.copy(self._v)"),
            _holder("Box", made, "self._v"),
        )
        for kind, made, change, size in (
            ("set", "{1, 2}", "v.add(3)", 2),
            ("bytearray", "bytearray(b'ab')", "v.extend(b'c')", 2),
            ("deque", "collections.deque([1, 2])", "v.append(3)", 2),
            ("Counter", "collections.Counter('ab')", "v['c'] += 1", 2),
            ("OrderedDict", "collections.OrderedDict(a=1)", "v['b'] = 2", 1),
            ("defaultdict", "collections.defaultdict(list, a=[1])", "v['b'].append(2)", 1),
        )
    },
    # A fourth review: a change to a value the tests then let go of was dropped with it,
    # unsent; one list given to two calls was read as sent to both once either copied a
    # change back; a setter's change waited for no reading.
    "a result changed, then let go": (
        "s = Stack()\ns.push(1)\ns.items().append(99)\nassert s.size() == 1\n",
        _STACK % "list(self._items)" + _SIZE,
        _STACK % "self._items" + _SIZE,
    ),
    "a result changed, then deleted": (
        "s = Stack()\ns.push(1)\nxs = s.items()\nxs.append(99)\ndel xs\nassert s.size() == 1\n",
        _STACK % "list(self._items)" + _SIZE,
        _STACK % "self._items" + _SIZE,
    ),
    "one list given to two calls": (
        "d = [1]\na = Acc(d)\nb = Acc(d)\na.add(3)\nassert b.total() == 1\n",
        _ACC % "list(data)",
        _ACC % "data",
    ),
    # A fifth review: a list of namedtuples was a copy (each made again), and one large
    # result made the answer's side forget every kept value the tests still changed.
    "a leaked list of namedtuples": (
        "d = Deck()\ncs = d.cards()\ncs.pop()\nassert d.size() == 52\n",
        _DECK % "list(self._cards)",
        _DECK % "self._cards",
    ),
    "a leaked list, then a large result": (
        "s = Stack()\ns.push(1)\nxs = s.items()\ns.push(2)\nxs.append(99)\nassert s.size() == 2\n",
        _BIG % "list(self._items)",
        _BIG % "self._items",
    ),
    "a setter that sorts the tests' list": (
        "b = Bag()\nxs = [3, 1, 2]\nb.items = xs\nassert xs == [3, 1, 2]\n",
        _BAG % "sorted(v)",
        _BAG % "v; v.sort()",
    ),
}


@pytest.mark.parametrize("name", sorted(SHARED_CHANGES))
async def test_a_change_the_tests_make_reaches_the_answer_as_in_one_program(
    pool: SandboxPool, name: str
) -> None:
    tests, right, wrong = SHARED_CHANGES[name]
    assert await wrong_scores(pool, tests, right, wrong) == 0.0


# 17. Re-attacks of 16: what the classic recipe passes must pass here, where the answer
#     shares its values with the tests: one it replaced since, one reached by two calls,
#     an argument it returns in a later call. Each (answer, tests).
SHARED_AS_IN_ONE_PROGRAM = {
    "a list the answer replaced since it leaked it": (
        _STACK % "self._items" + "    def reset(self):\n        self._items = []\n",
        "s = Stack()\ns.push(1)\nxs = s.items()\ns.reset()\nxs.append(99)\n"
        "assert s.items() == []\nassert xs == [1, 99]\n",
    ),
    "an argument the answer replaced since it kept it": (
        _TOTAL % "data" + "    def reset(self):\n        self.data = []\n",
        "d = [1]\na = Total(d)\na.reset()\nd.append(5)\n"
        "assert a.total() == 0\nassert d == [1, 5]\n",
    ),
    "one list returned by two calls": (
        _STACK % "self._items",
        "s = Stack()\ns.push(1)\nxs = s.items()\nys = s.items()\nassert xs is ys\n"
        "xs.append(5)\ns.push(7)\nassert s.items() == [1, 5, 7]\nassert ys == [1, 5, 7]\n",
    ),
    "a change the answer makes to a list it leaked": (
        _STACK % "self._items",
        "s = Stack()\nxs = s.items()\ns.push(1)\nassert xs == [1]\n",
    ),
    "an argument the answer kept, returned by a later call": (
        _TOTAL % "data" + "    def view(self):\n        return self.data\n",
        "d = [1]\na = Total(d)\nv = a.view()\nassert v is d\nv.append(2)\n"
        "assert a.total() == 3\nassert d == [1, 2]\n",
    ),
    "a leaked list the tests change twice between calls": (
        _STACK % "self._items" + "    def size(self):\n        return len(self._items)\n",
        "s = Stack()\nxs = s.items()\nxs.append(1)\nxs.append(2)\nxs.remove(1)\n"
        "assert s.size() == 1\nassert s.items() == [2]\n",
    ),
    "a tree built through its node's list": (
        "class Node:\n    def __init__(self, v):\n        self.v = v\n        self.children = []\n"
        "    def count(self):\n        return 1 + sum(c.count() for c in self.children)\n",
        "root = Node(1)\nroot.children.append(Node(2))\nassert root.count() == 2\n",
    ),
    "one list given to two calls, changed by one": (
        _ACC % "data",
        "d = [1]\na = Acc(d)\nb = Acc(d)\na.add(3)\nassert b.total() == 4\nassert d == [1, 3]\n",
    ),
    "a leaked list the tests change after a pop": (
        _STACK % "self._items" + _SIZE + "    def pop(self):\n        return self._items.pop()\n",
        "s = Stack()\ns.push(1)\ns.push(2)\nxs = s.items()\nassert s.pop() == 2\n"
        "xs[0] = 10\nassert s.size() == 1\n",
    ),
    "a list of namedtuples returned as it was passed": (
        "def ident(xs):\n    return xs\n",
        "from collections import namedtuple\nP = namedtuple('P', 'x y')\nxs = [P(1, 2)]\n"
        "assert ident(xs) is xs\n",
    ),
    "kept rows of namedtuples, then an add": (
        _DB,
        "d = Db()\nd.add('a', 1)\nr = d.rows()\nd.add('b', 2)\nassert len(r) == 2\n"
        "assert d.rows() is d.rows()\n",
    ),
    "a kept list beside a large argument": (
        _TOTAL % "data" + "    def note(self, msg, tags):\n        return len(msg)\n",
        "d = [1]\nt = Total(d)\nt.note('y' * (1 << 20), [])\nd.append(5)\nassert t.total() == 6\n",
    ),
    "a setter that sorts the list its object kept": (
        "class View:\n    def __init__(self, data):\n        self.data = data\n"
        "    @property\n    def descending(self):\n        return False\n"
        "    @descending.setter\n    def descending(self, flag):\n"
        "        self.data.sort(reverse=flag)\n",
        "d = [3, 1, 2]\nv = View(d)\nv.descending = True\nassert d == [3, 2, 1]\n",
    ),
    "a copy the tests change, then the answer's own list": (
        _STACK % "list(self._items)" + "    def size(self):\n        return len(self._items)\n",
        "s = Stack()\ns.push(1)\nxs = s.items()\nxs.clear()\nassert s.size() == 1\n"
        "s.push(2)\nassert xs == [] and s.items() == [1, 2]\n",
    ),
}


@pytest.mark.parametrize("name", sorted(SHARED_AS_IN_ONE_PROGRAM))
async def test_values_both_sides_hold_stay_one_value(pool: SandboxPool, name: str) -> None:
    answer, tests = SHARED_AS_IN_ONE_PROGRAM[name]
    assert classic(answer, tests)
    assert (await judge(pool, answer, tests)).score() == 1.0
