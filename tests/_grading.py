"""What the code-reward tests share: short limits, a local sandbox pool, one graded call,
and the classic recipe to compare with."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

import pytest

import tangram
from tangram._reward._grade import Verdict, grade
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import SandboxPool

# Short limits: the hacks that hang cost their timeout, and there are several.
LIMITS = {"timeout": 8.0, "case_timeout": 2.0}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def local_pool(warm: int = 2) -> AsyncIterator[SandboxPool]:
    """A pool of ``warm`` local sandboxes under a runtime with its capacity."""
    async with (
        SandboxPool(LocalBackend(), warm=warm) as sandboxes,
        tangram.Runtime(capacity=sandboxes.capacity()),
    ):
        yield sandboxes


@pytest.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    async with local_pool() as sandboxes:
        yield sandboxes


async def judge(pool: SandboxPool, answer: str, tests: object, **limits: float) -> Verdict:
    async with pool.sandbox("graded") as sandbox:
        return await grade(sandbox, answer, tests, **{**LIMITS, **limits})


def classic(answer: str, tests: str) -> bool:
    """The classic recipe, to check a test's claim about it: answer and tests as one
    program, passed where it exits 0, in a directory of its own (an answer may keep
    state in files)."""
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            [sys.executable, "-c", answer + "\n" + tests],
            capture_output=True,
            timeout=60,
            cwd=cwd,
        )
    return done.returncode == 0


async def wrong_scores(pool: SandboxPool, tests: str, right: str, wrong: str) -> float:
    """What ``wrong`` scores, once the case is checked: the classic recipe passes
    ``right`` and fails ``wrong``, and ``right`` scores 1.0 here."""
    assert classic(right, tests) and not classic(wrong, tests)
    assert (await judge(pool, right, tests)).score() == 1.0
    return (await judge(pool, wrong, tests)).score()
