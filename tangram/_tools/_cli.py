"""The ``tangram`` command: a thin layer over the public API.

Results go to standard output, progress and diagnostics to standard error, so
``tangram simulate ... > table.txt`` and pipes get only the results. Exit codes:

- 0: done;
- 1: the run failed for an outside cause (no Docker daemon, a missing extra, a sandbox
  that broke), or ``tangram bench --check`` found a target not met;
- 2: usage or input errors: a bad flag, an unreadable input or unwritable output path
  (found before anything runs), a malformed trace, a config or capacity that makes no
  sense;
- 130: interrupted (Ctrl-C), after everything started was closed.

Errors tangram raises on purpose print as ``Type: message``; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from .. import __version__
from .._sandbox._backend import BACKENDS
from ..errors import TangramError
from ._bench import BenchConfig
from ._paths import STDIO, input_file, output_dir
from ._report import add_commands as _add_simulate_commands
from ._report import check_generate as _check_generate
from ._report import dispatch as _dispatch_simulate

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
"""The run failed for an outside cause, or a checked target was not met."""
EXIT_USAGE = 2
"""A bad flag, path, trace, config or capacity: what the caller gave cannot work (argparse's
code for usage errors)."""
EXIT_INTERRUPTED = 130


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
        prog="tangram",
        description="Action-level resource scheduling for agentic RL.",
        epilog=(
            "Results go to stdout, progress and errors to stderr; - is stdin or stdout "
            "wherever a file is read or written. Exit codes: 0 done, 1 the run failed (or a "
            "checked target was not met), 2 usage or input error, 130 interrupted."
        ),
    )
    parser.add_argument("--version", action="version", version=f"tangram {__version__}")
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
    doctor.add_argument(
        "--json", action="store_true", help="print the facts as one JSON object instead"
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
    fusion.add_argument(
        "--config",
        type=_config_file,
        metavar="PATH",
        help="the tangram config (default: $TANGRAM_CONFIG)",
    )
    fusion.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    fusion.add_argument("--port", type=int, default=8080, help="default: 8080; 0 picks one")
    fusion.add_argument(
        "--cpu", type=_positive_int, default=1, metavar="N", help="cores per request (default 1)"
    )


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
    bench.add_argument(
        "--trajectories", type=_positive_int, metavar="N", help="default: three per core"
    )
    defaults = attrs.fields(BenchConfig)
    bench.add_argument(
        "--turns",
        type=_positive_int,
        default=defaults.turns.default,
        metavar="N",
        help="turns per trajectory (default %(default)s)",
    )
    bench.add_argument(
        "--cores",
        type=_positive_int,
        metavar="N",
        help="cores to lend (default: all this process may use)",
    )
    bench.add_argument(
        "--seed",
        type=int,
        default=defaults.seed.default,
        help="the plan's seed (default %(default)s)",
    )
    bench.add_argument(
        "--sandbox",
        choices=tuple(BACKENDS),
        default=defaults.sandbox.default,
        help="where the sandboxes live (default %(default)s, which needs nothing but this "
        "host; see docs/sandboxes.md)",
    )
    bench.add_argument(
        "--time-scale",
        type=_positive_float,
        default=defaults.time_scale.default,
        metavar="X",
        help="multiply LLM gaps and the jobs per action (smaller runs faster; default %(default)s)",
    )
    bench.add_argument(
        "--search-rate",
        type=_positive_float,
        default=defaults.search_rate.default,
        metavar="RATE",
        help="the search service's requests per second (default %(default)s)",
    )
    bench.add_argument(
        "--rounds",
        type=_positive_int,
        default=defaults.rounds.default,
        metavar="N",
        help="rounds of the tangram and verl arms, alternating which goes first; verl's "
        "ratios are their median (default %(default)s)",
    )
    bench.add_argument(
        "--out",
        type=output_dir,
        metavar="DIR",
        help="write report.json, table.txt, act.png and cores.png into this directory",
    )
    bench.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a ratio misses its target (the `targets` of report.json)",
    )


def _config_file(text: str) -> str:
    """A config path that can be read now: a typo fails before the pool starts."""
    if text == STDIO:
        raise argparse.ArgumentTypeError(
            "is read by path (its suffix says TOML or YAML); - (standard input) is not one"
        )
    input_file(text)
    return text


def _bench(args: argparse.Namespace) -> int:
    # Imported here: the bench needs torch and httpx, which `tangram simulate` does not.
    from ._bench import default_config, run_bench
    from ._bench_report import bench_table, live_progress, report, write_report

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
            return EXIT_FAILED
    fields = (
        "trajectories",
        "cores",
        "turns",
        "seed",
        "sandbox",
        "time_scale",
        "search_rate",
        "rounds",
    )
    config = default_config(**{name: getattr(args, name) for name in fields})
    # Progress on stderr (live on a terminal), so stdout carries the table alone.
    with live_progress(config.trajectories * (config.turns + 1), sys.stderr) as hook:
        result = run_bench(config, hook)
    print(bench_table(result))
    if args.out is not None:
        paths = write_report(result, args.out)
        print("wrote " + ", ".join(str(path) for path in paths))
    if args.check:
        missed = [
            f"{name} {target['value']:.2f} (goal {target['goal']})"
            for name, target in report(result)["targets"].items()
            if not target["met"]
        ]
        if missed:
            print("targets not met: " + ", ".join(missed), file=sys.stderr)
            return EXIT_FAILED
    return EXIT_OK


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import diagnose, format_diagnosis, reap_orphaned_sandboxes

    if args.reap:
        try:
            removed = reap_orphaned_sandboxes()
        except Exception as exc:  # no daemon, or no aiodocker: said, as the probes do
            print(f"cannot reap: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_FAILED
    facts = diagnose()
    if args.json:
        # One JSON document on stdout, what was reaped in it.
        if args.reap:
            facts["reaped"] = removed
        print(json.dumps(facts, indent=2))
        return EXIT_OK
    if args.reap:
        print(f"removed {len(removed)} orphaned sandbox containers")
        for ident in removed:
            print(f"  {ident[:12]}")
    print(format_diagnosis(facts))
    return EXIT_OK


def _serve_fusion(args: argparse.Namespace) -> int:
    import signal

    import anyio

    from .._fusion import serve

    async def run() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with serve(args.config, host=args.host, port=args.port, cpu=args.cpu) as url:
                print(f"serving SandboxFusion run_code at {url}/run_code", flush=True)
                async for _ in signals:  # a job's SIGTERM stops it as cleanly as ^C
                    return

    anyio.run(run)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "bench":
        return _bench(args)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "serve-sandbox-fusion":
        return _serve_fusion(args)
    code = _dispatch_simulate(args)
    return EXIT_OK if code is None else code


def _exit_code(exc: TangramError) -> int:
    """2 for what the caller gave (the ValueError family), 1 for an outside cause."""
    return EXIT_USAGE if isinstance(exc, (ValueError, TypeError, LookupError)) else EXIT_FAILED


def _mute_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again.

    As the ``signal`` module's documentation advises for a reader that went away
    (``tangram trace generate | head``), instead of restoring SIGPIPE's default action.
    """
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a stream without one
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tangram`` command and return its exit code.

    Usage errors (and ``--help``, ``--version``) raise argparse's ``SystemExit`` (code 2,
    or 0), before anything runs; every other outcome is the returned code.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "simulate" and args.json == STDIO and args.plot == STDIO:
        parser.error("--json and --plot cannot both be - (standard output)")
    _check_generate(parser, args)
    try:
        code = _run(args)
        sys.stdout.flush()  # inside the try: a reader gone makes the flush raise
    except BrokenPipeError:
        _mute_stdout()
        return EXIT_FAILED
    except TangramError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return _exit_code(exc)
    except OSError as exc:
        if exc.filename is None:
            raise
        # A path that changed between the argument check and its use (vanished, filled up).
        print(f"tangram: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Everything the command started was closed while the interrupt unwound it.
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
