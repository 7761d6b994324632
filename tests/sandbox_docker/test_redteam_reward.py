"""Red team, round 3, on the code reward in Docker sandboxes: the same hacks and sweeps as
``tests/test_redteam_reward.py`` (local backend), since the harness runs the same way in
a container: under one uid with the answer, which may lower its limits."""

from __future__ import annotations

import anyio
import pytest
from _hacks import ROUND_3
from _reward_attacks import LIMITS, STAGES, limit_attack

from tangram._reward._grade import Verdict, grade
from tangram.errors import SandboxBrokenError

from .docker_support import Setup

pytestmark = pytest.mark.anyio


async def _judge(setup: Setup, answer: str, tests: object) -> Verdict:
    async with setup.pool.sandbox("reward") as sandbox:
        with anyio.fail_after(60):
            return await grade(sandbox, answer, tests, timeout=12, case_timeout=4)


@pytest.mark.parametrize("name", sorted(ROUND_3))
async def test_a_round_3_hack_scores_zero(setup: Setup, name: str) -> None:
    verdict = await _judge(setup, ROUND_3[name].answer, ROUND_3[name].tests)
    assert verdict.passed == 0, verdict


@pytest.mark.parametrize("kind", ["assert", "call", "stdio"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("limit", LIMITS)
async def test_a_judge_limit_the_answer_lowers_never_stops_the_step(
    setup: Setup, limit: str, stage: str, kind: str
) -> None:
    answer, tests = limit_attack(limit, stage, kind)
    try:
        verdict = await _judge(setup, answer, tests)
    except SandboxBrokenError as exc:
        pytest.fail(f"a wrong answer turned its 0 into an infrastructure failure: {exc}")
    assert verdict.score() == 0.0, verdict
