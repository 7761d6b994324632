"""Answers that lower their judge's limits, shared by the local and Docker red-team tests.

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
