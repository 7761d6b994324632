"""The ``tangram`` command: a thin layer over the public API.

Errors tangram raises on purpose print as ``Type: message`` and exit 1; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ._demo import ArmResult, DemoConfig, DemoResult, run_demo
from ._report import add_commands as _add_simulate_commands
from ._report import dispatch as _dispatch_simulate
from .errors import TangramError

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {value})")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tangram", description="Action-level resource scheduling for agentic RL."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="run a synthetic rollout step live, under tangram and under static allocation",
        description=(
            "Runs the same synthetic coding-agent rollout twice on the live runtime: with "
            "tangram's elastic policy and with a fixed per-trajectory slot, and prints both."
        ),
    )
    defaults = DemoConfig()
    demo.add_argument("--trajectories", type=_positive_int, default=defaults.trajectories)
    demo.add_argument("--turns", type=_positive_int, default=defaults.turns)
    demo.add_argument("--cores", type=_positive_int, default=defaults.cores)
    demo.add_argument("--max-cores", type=_positive_int, default=defaults.max_cores)
    demo.add_argument("--seed", type=int, default=defaults.seed)
    demo.add_argument(
        "--time-scale",
        type=_positive_float,
        default=defaults.time_scale,
        help="multiply every modelled duration (smaller runs faster)",
    )
    demo.add_argument("--json", type=Path, help="also write the figures to this file")
    _add_simulate_commands(commands)
    return parser


def _row(arm: ArmResult) -> str:
    return (
        f"{arm.name:<8} {arm.avg_act:>8.3f} {arm.p95_act:>8.3f} {arm.queue:>8.3f} "
        f"{arm.exec:>8.3f} {arm.overhead:>9.4f} {arm.step_seconds:>8.2f} {arm.core_seconds:>10.1f}"
    )


def _report(result: DemoResult) -> dict[str, object]:
    config = result.config
    print(
        f"tangram demo: {config.trajectories} trajectories x {config.turns} turns on "
        f"{config.cores} cores (elastic actions up to {config.max_cores}), seed {config.seed}"
    )
    print(
        f"{'policy':<8} {'avg ACT':>8} {'p95 ACT':>8} {'queue':>8} {'exec':>8} "
        f"{'overhead':>9} {'step s':>8} {'core-s':>10}"
    )
    print(_row(result.tangram))
    print(_row(result.static))
    ratios = result.ratios()
    print(
        "static / tangram: " + ", ".join(f"{name} {value:.2f}x" for name, value in ratios.items())
    )
    figures: dict[str, object] = {
        arm.name: {
            "avg_act": arm.avg_act,
            "p95_act": arm.p95_act,
            "avg_queue": arm.queue,
            "avg_exec": arm.exec,
            "avg_overhead": arm.overhead,
            "step_seconds": arm.step_seconds,
            "core_seconds": arm.core_seconds,
            "actions": len(arm.acts),
        }
        for arm in (result.tangram, result.static)
    }
    figures["ratios"] = ratios
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            config = DemoConfig(
                trajectories=args.trajectories,
                turns=args.turns,
                cores=args.cores,
                max_cores=args.max_cores,
                seed=args.seed,
                time_scale=args.time_scale,
            )
            figures = _report(run_demo(config))
            if args.json is not None:
                args.json.write_text(json.dumps(figures, indent=2) + "\n")
        else:
            code = _dispatch_simulate(args)
            if code is not None:
                return code
    except TangramError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
