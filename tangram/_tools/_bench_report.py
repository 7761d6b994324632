"""What ``tangram bench`` shows: live progress, the table, and the report a person opens.

Kept apart from :mod:`tangram._tools._bench` so that the measuring code has no display in it;
everything here reads a finished :class:`~tangram._tools._bench.BenchResult` (or one action at a
time, for the live view). matplotlib is an optional extra (``plot``), imported only when
``--out`` asks for the figures.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import attrs

from ._bench import ArmOutcome, BenchResult, MeasuredAction, ProgressHook

__all__ = ["TARGETS", "live_progress", "summarise_arm", "bench_table", "write_report"]

TARGETS = {"step_seconds": 1.5, "avg_act": 2.0, "verl_avg_act": 1.3, "verl_step_seconds": 1.0}
"""Baseline over tangram ratios the main job aims for at the default size on 2 cores: static
(``step_seconds``, ``avg_act``) and verl's per-call semaphore (``verl_...``: ACT 1.3x
better, the step no longer)."""


@attrs.frozen
class ArmSummary:
    """One arm's figures: per-action ACT split and the step's resource bill."""

    name: str
    acts: tuple[float, ...]
    queue: float
    exec: float
    overhead: float
    step_seconds: float
    core_seconds: float

    @property
    def avg_act(self) -> float:
        return statistics.fmean(self.acts)

    @property
    def p95_act(self) -> float:
        ordered = sorted(self.acts)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def summarise_arm(arm: ArmOutcome) -> ArmSummary:
    """The arm's averages, as the table and the report show them."""
    records = arm.records
    return ArmSummary(
        arm.name,
        tuple(r.act for r in records),
        statistics.fmean(r.queue for r in records),
        statistics.fmean(r.exec for r in records),
        statistics.fmean(r.overhead for r in records),
        arm.step_seconds,
        arm.core_seconds,
    )


def _over(base: ArmSummary, ours: ArmSummary, prefix: str) -> dict[str, float]:
    return {
        f"{prefix}avg_act": base.avg_act / ours.avg_act,
        f"{prefix}p95_act": base.p95_act / ours.p95_act,
        f"{prefix}step_seconds": base.step_seconds / ours.step_seconds,
        f"{prefix}core_seconds": base.core_seconds / ours.core_seconds,
    }


def round_ratios(result: BenchResult) -> list[dict[str, float]]:
    """verl over tangram in each round, the first round's first."""
    return [
        _over(summarise_arm(verl), summarise_arm(tangram), "verl_")
        for tangram, verl in result.rounds
    ]


def ratios(result: BenchResult) -> dict[str, float]:
    """Each baseline over tangram (static unprefixed, verl ``verl_``): above 1, tangram is
    better. verl's are the median over the rounds (:func:`round_ratios`)."""
    rounds = round_ratios(result)
    return {
        **_over(summarise_arm(result.static), summarise_arm(result.tangram), ""),
        **{name: statistics.median(r[name] for r in rounds) for name in rounds[0]},
    }


def bench_table(result: BenchResult) -> str:
    """The text table printed at the end of a run (and quoted in the docs)."""
    config = result.config
    lines = [
        f"tangram bench: {config.trajectories} trajectories x {config.turns} turns, "
        f"{config.cores} cores, {result.backend} sandboxes, seed {config.seed}",
        f"{'arm':<8} {'actions':>7} {'avg ACT':>8} {'p95 ACT':>8} {'queue':>7} {'exec':>7} "
        f"{'overhead':>8} {'step s':>7} {'core-s':>7}",
    ]
    for arm in result.arms:
        s = summarise_arm(arm)
        lines.append(
            f"{s.name:<8} {len(s.acts):>7} {s.avg_act:>8.3f} {s.p95_act:>8.3f} {s.queue:>7.3f} "
            f"{s.exec:>7.3f} {s.overhead:>8.3f} {s.step_seconds:>7.1f} {s.core_seconds:>7.1f}"
        )
    r = ratios(result)
    rounds = round_ratios(result)
    for name, prefix in (("static", ""), ("verl", "verl_")):
        line = (
            f"{name} / tangram: avg ACT {r[prefix + 'avg_act']:.2f}x, "
            f"p95 ACT {r[prefix + 'p95_act']:.2f}x, step {r[prefix + 'step_seconds']:.2f}x, "
            f"core-s {r[prefix + 'core_seconds']:.2f}x"
        )
        if prefix and len(rounds) > 1:
            acts = [each["verl_avg_act"] for each in rounds]
            steps = [each["verl_step_seconds"] for each in rounds]
            line += (
                f" (median of {len(rounds)} rounds; avg ACT {min(acts):.2f}-{max(acts):.2f}x, "
                f"step {min(steps):.2f}-{max(steps):.2f}x)"
            )
        lines.append(line)
    for arm in result.arms:
        kinds = sorted({rec.kind for rec in arm.records})
        parts = []
        for kind in kinds:
            acts = [rec.act for rec in arm.records if rec.kind == kind]
            parts.append(f"{kind} {statistics.fmean(acts):.2f}s x{len(acts)}")
        lines.append(
            f"{arm.name:<8} by kind: {', '.join(parts)}; reward models: "
            f"{arm.gpu['restores']} restores, {arm.gpu['evictions']} evictions; search: "
            f"{arm.search['accepted']} answered, {arm.search['rejected']} refused"
        )
    return "\n".join(lines)


def _rounded(value: Any) -> Any:
    """Figures to the microsecond at most: the report stays small enough to keep in a repo."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(item) for item in value]
    return value


def _arm_json(arm: ArmOutcome) -> dict[str, Any]:
    s = summarise_arm(arm)
    return {
        "actions": len(arm.records),
        "avg_act": s.avg_act,
        "p95_act": s.p95_act,
        "avg_queue": s.queue,
        "avg_exec": s.exec,
        "avg_overhead": s.overhead,
        "step_seconds": arm.step_seconds,
        "core_seconds": arm.core_seconds,
        "busy_core_seconds": arm.busy_core_seconds,
        "cpu_seconds": arm.cpu_seconds,
        "gpu": arm.gpu,
        "search": arm.search,
        "rewards": arm.rewards,
        "records": [{**attrs.asdict(rec), "act": rec.act} for rec in arm.records],
        "timeline": [list(sample) for sample in arm.timeline],
    }


def _brief(arm: ArmOutcome) -> dict[str, float]:
    s = summarise_arm(arm)
    return {"avg_act": s.avg_act, "p95_act": s.p95_act, "step_seconds": s.step_seconds}


def report(result: BenchResult) -> dict[str, Any]:
    """The JSON report: configuration, the first round's arms in full, each round's
    tangram and verl figures, ratios (verl's the rounds' median) and targets."""
    r = ratios(result)
    return {
        "bench": "tangram_bench",
        "config": attrs.asdict(result.config),
        "backend": result.backend,
        "arms": {arm.name: _arm_json(arm) for arm in result.arms},
        "rounds": [
            {"tangram": _brief(tangram), "verl": _brief(verl), "ratios": each}
            for (tangram, verl), each in zip(result.rounds, round_ratios(result), strict=True)
        ],
        "ratios": r,
        "targets": {
            name: {"value": r[name], "goal": f">= {goal:g}", "met": r[name] >= goal}
            for name, goal in TARGETS.items()
        },
    }


def write_report(result: BenchResult, out: Path) -> list[Path]:
    """Write ``report.json``, ``table.txt``, ``act.png`` and ``cores.png`` into ``out``.

    Returns the paths written.

    :raises ImportError: matplotlib is missing (the ``plot`` extra).
    """
    try:
        # Figures without pyplot: no global backend switch in the caller's process.
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "tangram bench --out needs matplotlib for its figures: pip install 'tangram[plot]'"
        ) from exc

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "act.png", out / "cores.png", out / "table.txt"]
    paths[0].write_text(json.dumps(_rounded(report(result)), separators=(",", ":")) + "\n")
    paths[3].write_text(bench_table(result) + "\n")
    colours = {"tangram": "tab:blue", "static": "tab:orange", "verl": "tab:green"}

    figure = Figure(figsize=(7, 3.6))
    axes = figure.subplots()
    for arm in result.arms:
        acts = sorted(rec.act for rec in arm.records)
        shares = [(i + 1) / len(acts) for i in range(len(acts))]
        mean = statistics.fmean(acts)
        axes.step(acts, shares, where="post", color=colours[arm.name], label=arm.name)
        axes.axvline(mean, color=colours[arm.name], linestyle=":", linewidth=1)
    axes.set_xscale("log")
    axes.set_xlabel("action completion time, s (log; dotted: mean)")
    axes.set_ylabel("share of actions")
    axes.set_title("ACT distribution, same actions under every arm")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(paths[1], dpi=90)

    figure = Figure(figsize=(7, 6.2))
    rows = figure.subplots(len(result.arms), 1, sharex=True, sharey=True)
    cores = result.config.cores
    for axes, arm in zip(rows, result.arms, strict=True):
        times = [t for t, _, _ in arm.timeline]
        axes.step(
            times,
            [h for _, h, _ in arm.timeline],
            where="post",
            color=colours[arm.name],
            label="granted to running actions",
        )
        if arm.name == "static":
            axes.step(
                times,
                [r for _, _, r in arm.timeline],
                where="post",
                color="grey",
                linestyle="--",
                label="reserved by trajectory slots",
            )
        axes.axhline(cores, color="black", linewidth=0.6)
        axes.set_ylabel("cores")
        axes.set_title(f"{arm.name}: step {arm.step_seconds:.1f} s", fontsize=10)
        axes.legend(loc="upper right", fontsize=8)
    rows[-1].set_xlabel("seconds since the step started")
    figure.tight_layout()
    figure.savefig(paths[2], dpi=90)
    return paths


@contextmanager
def live_progress(total: int, stream: TextIO | None = None) -> Iterator[ProgressHook]:
    """A progress hook: a rich display on a terminal, a plain line per 10% otherwise.

    ``stream`` defaults to standard error: progress is not a result, and stdout carries
    the table alone.
    """
    stream = stream if stream is not None else sys.stderr
    if stream.isatty() and importlib.util.find_spec("rich") is not None:
        with _rich_progress(total, stream) as hook:
            yield hook
        return
    done: dict[str, int] = {}

    def plain(arm: str, record: MeasuredAction | None) -> None:
        if record is None:
            done[arm] = 0
            print(f"{arm}: running {total} actions", file=stream, flush=True)
            return
        done[arm] += 1
        step = max(1, total // 10)
        if done[arm] % step == 0 or done[arm] == total:
            print(
                f"{arm}: {done[arm]}/{total} actions, at {record.wanted + record.act:.1f} s",
                file=stream,
                flush=True,
            )

    yield plain


@contextmanager
def _rich_progress(total: int, stream: TextIO) -> Iterator[ProgressHook]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description:<8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
        console=Console(file=stream),
    )
    tasks: dict[str, Any] = {}

    def hook(arm: str, record: MeasuredAction | None) -> None:
        if record is None:
            tasks[arm] = progress.add_task(arm, total=total, last="")
            return
        last = f"{record.trajectory} {record.kind}: ACT {record.act:.2f} s"
        if record.max_units:
            last += f" on {record.max_units} core{'s' if record.max_units > 1 else ''}"
        progress.update(tasks[arm], advance=1, last=last)

    with progress:
        yield hook
