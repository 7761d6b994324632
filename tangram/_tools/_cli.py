"""The ``tangram`` command: a thin layer over the public API.

Errors tangram raises on purpose print as ``Type: message`` and exit 1; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ..errors import TangramError
from ._bench import BenchConfig
from ._report import add_commands as _add_simulate_commands
from ._report import dispatch as _dispatch_simulate

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
    _add_bench_command(commands)
    doctor = commands.add_parser(
        "doctor",
        help="print what this host offers tangram and what `tangram bench` will use",
        description="Probes cores, cgroups, Docker, GPUs (NVML), Ray and torch; never fails.",
    )
    doctor.add_argument(
        "--reap",
        action="store_true",
        help="remove the sandbox containers left by trainers of this host that are gone",
    )
    _add_fusion_command(commands)
    _add_simulate_commands(commands)
    return parser


def _add_fusion_command(commands: Any) -> None:
    fusion = commands.add_parser(
        "serve-sandbox-fusion",
        help="serve SandboxFusion's run_code API from tangram's sandbox pool (verl's URLs)",
        description=(
            "Serves POST /run_code and GET /v1/ping as SandboxFusion does, running each request "
            "in a fresh sandbox of the config's [sandbox] pool under tangram's scheduler. Point "
            "verl's reward.sandbox_fusion.url (or a tool's sandbox_fusion_url) at "
            "http://HOST:PORT/run_code."
        ),
    )
    fusion.add_argument("--config", help="the tangram config (default: $TANGRAM_CONFIG)")
    fusion.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    fusion.add_argument("--port", type=int, default=8080, help="default: 8080; 0 picks one")
    fusion.add_argument("--cpu", type=_positive_int, default=1, help="cores per request")


def _add_bench_command(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="run a real rollout step on this machine: tangram, static slots, verl's semaphore",
        description=(
            "Runs the same coding-agent rollout step three times on real executors: tests and "
            "builds in sandboxes, a rate-limited search service on loopback and torch reward "
            "models behind the GPU-service pool; once with tangram's elastic policy, once with "
            "a fixed per-trajectory slot and once with verl's semaphore around each sandbox "
            "call at one core per call; then prints the measured figures."
        ),
    )
    bench.add_argument("--trajectories", type=_positive_int, help="default: three per core")
    defaults = attrs.fields(BenchConfig)
    bench.add_argument(
        "--turns", type=_positive_int, default=defaults.turns.default, help="turns per trajectory"
    )
    bench.add_argument(
        "--cores", type=_positive_int, help="cores to lend (default: all this process may use)"
    )
    bench.add_argument("--seed", type=int, default=defaults.seed.default, help="the plan's seed")
    bench.add_argument("--sandbox", choices=("local", "docker"), default=defaults.sandbox.default)
    bench.add_argument(
        "--time-scale",
        type=_positive_float,
        default=defaults.time_scale.default,
        help="multiply LLM gaps and the jobs per action (smaller runs faster)",
    )
    bench.add_argument(
        "--search-rate",
        type=_positive_float,
        default=defaults.search_rate.default,
        help="the search service's requests per second",
    )
    bench.add_argument(
        "--out",
        type=Path,
        help="write report.json, table.txt, act.png and cores.png into this directory",
    )


def _bench(args: argparse.Namespace) -> int:
    # Imported here: the bench needs torch and httpx, which `tangram simulate` does not.
    from ._bench import default_config, run_bench
    from ._bench_report import bench_table, live_progress, write_report

    needed = [("tangram.gpu", "gpu"), ("tangram.quota", "api")]
    if args.out is not None:
        needed.append(("matplotlib", "plot"))
    for module, extra in needed:
        # Checked before anything starts: a missing extra should not cost a half-run.
        try:
            importlib.import_module(module)
        except ImportError as exc:
            print(
                f"ImportError: tangram bench{' --out' if extra == 'plot' else ''} needs "
                f"{module}: pip install 'tangram[{extra}]' ({exc})",
                file=sys.stderr,
            )
            return 1
    fields = ("trajectories", "cores", "turns", "seed", "sandbox", "time_scale", "search_rate")
    config = default_config(**{name: getattr(args, name) for name in fields})
    with live_progress(config.trajectories * (config.turns + 1)) as hook:
        result = run_bench(config, hook)
    print(bench_table(result))
    if args.out is not None:
        paths = write_report(result, args.out)
        print("wrote " + ", ".join(str(path) for path in paths))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import diagnose, format_diagnosis, reap_orphaned_sandboxes

    if args.reap:
        try:
            removed = reap_orphaned_sandboxes()
        except Exception as exc:  # no daemon, or no aiodocker: said, as the probes do
            print(f"cannot reap: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(f"removed {len(removed)} orphaned sandbox containers")
        for ident in removed:
            print(f"  {ident[:12]}")
    print(format_diagnosis(diagnose()))
    return 0


def _serve_fusion(args: argparse.Namespace) -> int:
    import signal

    import anyio

    from .._frameworks._fusion import serve

    async def run() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with serve(args.config, host=args.host, port=args.port, cpu=args.cpu) as url:
                print(f"serving SandboxFusion run_code at {url}/run_code", flush=True)
                async for _ in signals:  # a job's SIGTERM stops it as cleanly as ^C
                    return

    anyio.run(run)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "bench":
            return _bench(args)
        elif args.command == "doctor":
            return _doctor(args)
        elif args.command == "serve-sandbox-fusion":
            return _serve_fusion(args)
        else:
            code = _dispatch_simulate(args)
            if code is not None:
                return code
    except TangramError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Everything the command started was closed while the interrupt unwound it.
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
