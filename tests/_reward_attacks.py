"""Attack answers shared by several red-team tests: answers that lower their judge's limits
(the local and Docker suites), and one that searches memory and stdin for the tests.

The answer runs under its judge's uid, and ``prlimit`` needs nothing more to lower another
process's limits. Each attack is a wrong ``add`` (or program) that lowers one limit of its
parent, the harness, at one stage of the grading, then lets the harness carry on.
"""

from __future__ import annotations

from typing import Any

LIMITS = ("AS", "DATA", "NOFILE", "NPROC", "FSIZE", "STACK", "CPU")
"""Every resource limit that stands between the harness and its next buffer, file,
process, write, stack page or CPU second."""

STAGES = ("before", "between", "after")
"""Before the first case (the answer's top level, or the first input), during a middle
case, and during the last one (so the harness must still write its verdict)."""

# The first argument of each case says which stage it is.
_CASES = ((2, 3, 5, "before"), (-1, 4, 3, "between"), (10, 20, 30, "after"))
# A later case's input the harness must still prepare once its limits are low.
_LARGE = "#" * (256 << 10)

_LOWER = """
import os, resource

def _lower():
    pid = os.getppid()
    status = {}
    try:
        with open(f"/proc/{pid}/status") as lines:
            for line in lines:
                key, _, value = line.partition(":")
                status[key] = value.split()
    except OSError:
        pass

    def size(key):
        return int(status[key][0]) * 1024 if key in status else 1 << 20

    caps = {
        "AS": max(0, size("VmSize") - (1 << 20)),
        "DATA": max(0, size("VmData") - (1 << 20)),
        "NOFILE": 1,
        "NPROC": 1,
        "FSIZE": 0,
        "STACK": 16 << 10,
        "CPU": 1,
    }
    cap = caps[LIMIT]
    try:
        resource.prlimit(pid, getattr(resource, "RLIMIT_" + LIMIT), (cap, cap))
    except (OSError, ValueError):
        pass
"""


def limit_attack(limit: str, stage: str, kind: str) -> tuple[str, Any]:
    """A wrong answer that lowers its judge's ``limit`` at ``stage``, and its tests of
    ``kind`` (``assert``, ``call`` or ``stdio``)."""
    first = next(a for a, _, _, when in _CASES if when == stage)
    lower = f"LIMIT = {limit!r}\n" + _LOWER
    if kind == "stdio":
        answer = (
            lower + f"a, b = map(int, input().split())\nif a == {first}:\n    _lower()\nprint(0)\n"
        )
        inputs = [
            f"{a} {b}\n" + (_LARGE + "\n" if n else "") for n, (a, b, _, _) in enumerate(_CASES)
        ]
        outputs = [f"{c}\n" for _, _, c, _ in _CASES]
        return answer, {"inputs": inputs, "outputs": outputs}
    if stage == "before":
        answer = lower + "_lower()\n" + "def add(a, b):\n    return 0\n"
    else:
        answer = lower + f"def add(a, b):\n    if a == {first}:\n        _lower()\n    return 0\n"
    if kind == "call":
        tests: Any = {
            "fn_name": "add",
            "inputs": [[a, b] for a, b, _, _ in _CASES],
            "outputs": [c for _, _, c, _ in _CASES],
        }
    else:
        tests = "".join(f"assert add({a}, {b}) == {c}\n" for a, b, c, _ in _CASES)
    return answer, tests


# -- retries: answers that learn in one round of the tests and start them over ------------

# The answer cannot know the bits (they stand for any output it cannot compute). It answers
# 0 for what it has not learned, and keeps what it learns in a file across its processes.
# A check() ends at its first failing assert, so a call that never gets a successor was
# answered wrong. A process that starts after such a failure binds, one after another, common
# builtins (as wrappers: ``binds()`` reports only objects that are not the builtin itself)
# until one is a builtin the tests use: the harness raises _Rebound, discards the round and
# runs the tests again, now against the corrected answer. One round per builtin the tests use.
ORACLE = r"""
import builtins as _b, json as _j, os as _o
_P = _o.path.join(_o.getcwd(), ".oracle-state")
try:
    with open(_P) as _fh:
        _S = _j.load(_fh)
except Exception:
    _S = {"known": {}, "pending": None, "names": [], "want": False}
_CAND = ["abs", "str", "int", "max", "min", "sum", "round", "sorted", "list", "tuple",
         "bool", "float", "range", "set", "dict", "any", "all", "enumerate", "zip", "map"]

def _wrap(name):
    real = getattr(_b, name)
    def wrapper(*a, **k):
        return real(*a, **k)
    globals()[name] = wrapper

def _save():
    with open(_P, "w") as fh:
        _j.dump(_S, fh)

_learned = False
if not _S["want"] and _S["pending"] is not None:
    _x, _g, _guessed = _S["pending"]
    if _guessed:  # the last call of the previous process had no successor: it was wrong
        _S["known"][str(_x)] = 1 - _g
        _learned = True
_S["pending"] = None
_S["want"] = _learned
for _n in _S["names"]:
    _wrap(_n)

def _more():
    if _S["want"]:  # one more builtin reported as bound, until the harness starts over
        for n in _CAND:
            if n not in _S["names"]:
                _S["names"].append(n)
                _wrap(n)
                break

_more()
_save()

def len(x):  # contested from the start, so every round has a second reading
    return _b.len(x)

def secret_bit(x):
    if _S["pending"] is not None:  # the tests went on: the previous answer was right
        _S["known"][str(_S["pending"][0])] = _S["pending"][1]
    k = str(x)
    v = _S["known"].get(k, 0)
    _S["pending"] = [x, v, k not in _S["known"]]
    _more()
    _save()
    return v
"""

# HumanEval's form: one check(), which stops at the first failing assert, around builtins
# the tests use anyway (abs, str, int, max, min, round, sum, len).
ORACLE_TESTS = """
def check(candidate):
    assert candidate(11) == 0
    assert candidate(12) == 1
    assert round(candidate(13)) == 0
    assert abs(candidate(14)) == 1
    assert int(candidate(15)) == 0
    assert max(candidate(16), 0) == 1
    assert min(candidate(17), 1) == 0
    assert len(str(candidate(18))) == 1
    assert sum([candidate(19)]) == 1
"""


# MBPP's form (no entry point): a contested builtin is the answer's in the second reading,
# so ``sorted(EXPECTED)`` on the tests' side is a call into the answer, with the expected
# value as its argument, as in the classic recipe. Harmless while the first reading, run
# first against an answer that knew nothing, had failed the test for good; but the answer
# binds one more builtin the tests use right after it learned, the tests start over, and
# the new round's first reading was answered from what the second reading showed it.
LEAK = r"""
import builtins as _b, json as _j, os as _o
_P = _o.path.join(_o.getcwd(), ".leak-state")
try:
    with open(_P) as _fh:
        _S = _j.load(_fh)
except Exception:
    _S = {"table": {}, "names": [], "seq": [], "seq_done": False}
_S["seq_done"] = bool(_S["seq"])  # the first process recorded the order of the calls
_CAND = ["abs", "str", "int", "len", "max", "min", "sum", "round", "list", "tuple",
         "bool", "float", "range", "set", "dict", "any", "all", "enumerate", "zip", "map"]
_now = {"key": None, "seen": 0, "new": False}

def _save():
    with open(_P, "w") as fh:
        _j.dump(_S, fh)

def _wrap(name):
    real = getattr(_b, name)
    globals()[name] = lambda *a, **k: real(*a, **k)

def _start_over():  # bind the common builtins: one the tests use makes the harness start over
    for n in _CAND:
        if n not in _S["names"]:
            _S["names"].append(n)
            _wrap(n)
    _save()

for _n in _S["names"]:
    _wrap(_n)
_save()

def sorted(xs, **kw):  # contested: the tests' own sorted() calls land here in reading 2
    _now["seen"] += 1
    if _now["seen"] == 2 and _now["key"] is not None:  # sorted(mine) == sorted(EXPECTED)
        _S["table"][_now["key"]] = _b.list(xs)
        _now["new"] = True
        _save()
        if _S["seq"] and _now["key"] == _S["seq"][-1]:
            _start_over()
    return _b.sorted(xs, **kw)

def common(a, b):
    key = _j.dumps([a, b])
    if not _S["seq_done"]:
        _S["seq"].append(key)
        _save()
    elif _now["new"] and key == _S["seq"][-1]:  # the last call: all there is to learn is learned
        _start_over()
    _now["key"], _now["seen"] = key, 0
    return _S["table"].get(key, [])
"""

LEAK_TESTS = (
    "assert sorted(common([1, 2, 3], [2, 3, 4])) == sorted([3, 2])\n"
    "assert sorted(common([5, 6, 9], [9, 6, 7])) == sorted([6, 9])\n"
    "assert sorted(common([7, 8], [8, 1])) == sorted([8])\n"
    "assert len(common([], [1])) == 0\n"
)


# The answer's process looks for the secret (32 hex digits and the payload after it) and
# for the payload's keys: in its own memory, and on the stdin of every process it can open.
LOOKS_FOR_THE_SECRET = r"""
import os, re
SIGNS = re.compile(rb"[0-9a-f]{32}\n[{]|[\"]case[_]timeout[\"]|MARK[_]161803")

def _memory(pid):
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if "r" not in perms:
                continue
            low, high = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(low)
                yield mem.read(high - low)
            except (OSError, ValueError, OverflowError):
                continue

def f():
    found = []
    for page in _memory("self"):
        if SIGNS.search(page):
            found.append("own memory")
            break
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
            data = os.read(fd, 1 << 20)
            os.close(fd)
            if SIGNS.search(data):
                found.append(f"stdin of {pid}")
        except OSError:
            pass
        if pid != str(os.getpid()):
            try:
                if any(SIGNS.search(page) for page in _memory(pid)):
                    found.append(f"memory of {pid}")
            except OSError:
                pass
    return found or "nothing"
"""
NOTHING_FOUND = "assert f() == 'nothing'  # MARK_161803\n"
#: The same answer's control: it passes only where it found the tests in its own memory.
FOUND_IN_ITS_MEMORY = "assert 'own memory' in f()  # MARK_161803\n"
