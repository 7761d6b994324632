"""Turning simulation results into the table, the JSON and the plots of ``tangram simulate``.

The JSON is the "simulation result" of docs/traces.md. It is written with sorted keys and every
float rounded to 6 significant digits, so the same trace and seed give the same bytes on
any machine whose floating point agrees to that precision (a sum's last bits can depend
on summation order; six digits never do here). Plots need matplotlib, imported only when
a plot is asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .._sim._baselines import POLICIES, parse_policy, run_policy
from .._sim._family import member
from .._sim._generate import WORKLOADS, GenerateConfig, generate_lines
from .._sim._simulate import SimulationResult
from .._sim._trace import Trace, read_lines, read_trace
from ..errors import PlotUnavailableError, TraceFormatError, UnknownResourceError
from ._paths import STDIO, input_file, output_dir, output_file, plot_file, plot_format

__all__ = [
    "add_commands",
    "check_generate",
    "dispatch",
    "plot_acts",
    "plot_sweep",
    "summarise",
    "table",
    "to_json",
]


def _round(value: float) -> float:
    if not math.isfinite(value) or value == 0:
        return value
    return float(f"{value:.6g}")


def summarise(result: SimulationResult) -> dict[str, Any]:
    """One policy's entry of the result JSON (docs/traces.md, "A simulation result")."""
    records = result.records
    count = len(records)

    def mean(values: Sequence[float]) -> float:
        return math.fsum(values) / count if count else math.nan

    return {
        "avg_act": _round(mean([r.act for r in records])),
        "p50_act": _round(result.act_quantile(0.5)),
        "p95_act": _round(result.act_quantile(0.95)),
        "p99_act": _round(result.act_quantile(0.99)),
        "avg_queue": _round(mean([r.queue for r in records])),
        "avg_exec": _round(mean([r.exec for r in records])),
        # Restores of GPU services; resizes and cold starts cost nothing here.
        "avg_overhead": _round(mean([r.overhead for r in records])),
        "step_seconds": _round(result.step_seconds),
        "unit_seconds": {k: _round(v) for k, v in sorted(result.unit_seconds.items())},
        "peak_units": {k: _round(v) for k, v in sorted(result.peak_units.items())},
        "actions": count,
    }


def to_json(document: Mapping[str, Any]) -> str:
    """Stable text: sorted keys, two-space indent, a final newline; NaN written as null."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, Mapping):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(document), sort_keys=True, indent=2, allow_nan=False) + "\n"


def table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """A fixed-width table, one row per policy, in the order given."""
    head = (
        f"{'policy':<14} {'avg ACT':>9} {'p50':>9} {'p95':>9} {'p99':>9} {'queue':>9} "
        f"{'exec':>9} {'ovh':>6} {'step s':>9}  unit-seconds / peak units"
    )
    lines = [head]
    for name, s in summaries.items():
        bill = ", ".join(
            f"{kind} {s['unit_seconds'][kind]:.6g}/{s['peak_units'].get(kind, 0):g}"
            for kind in s["unit_seconds"]
        )
        lines.append(
            f"{name:<14} {s['avg_act']:>9.4g} {s['p50_act']:>9.4g} {s['p95_act']:>9.4g} "
            f"{s['p99_act']:>9.4g} {s['avg_queue']:>9.4g} {s['avg_exec']:>9.4g} "
            f"{s['avg_overhead']:>6.3g} {s['step_seconds']:>9.5g}  {bill}"
        )
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailableError("plots need matplotlib: pip install 'tangram[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# No timestamps (and, for SVG, fixed element ids), so the same run gives the same bytes.
_STABLE_METADATA: dict[str, dict[str, None]] = {
    "png": {"Software": None},
    "svg": {"Date": None},
    "pdf": {"CreationDate": None},
}


def _save(plt: Any, figure: Any, path: Path | IO[bytes], fmt: str | None) -> None:
    fmt = fmt or plot_format(str(path))
    with plt.rc_context({"svg.hashsalt": "tangram"}):
        figure.savefig(path, format=fmt, metadata=_STABLE_METADATA.get(fmt))
    plt.close(figure)


def plot_acts(
    results: Mapping[str, SimulationResult],
    title: str,
    path: Path | IO[bytes],
    fmt: str | None = None,
) -> None:
    """ACT distributions as empirical CDFs on a log axis: tails are where policies differ.

    ``fmt`` (png, svg or pdf) defaults to the path's extension.

    :raises PlotUnavailableError: matplotlib is missing.
    """
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        acts = sorted(max(r.act, 1e-6) for r in result.records)
        if not acts:
            continue
        count = len(acts)
        axis.step(acts, [(i + 1) / count for i in range(count)], where="post", label=name)
    axis.set_xscale("log")
    axis.set_xlabel("action completion time (s, virtual)")
    axis.set_ylabel("fraction of actions")
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    _save(plt, figure, path, fmt)


def plot_sweep(
    parameter: str,
    values: Sequence[float],
    ratios: Mapping[str, Sequence[float]],
    reference: str,
    title: str,
    path: Path | IO[bytes],
    fmt: str | None = None,
) -> None:
    """Average-ACT ratio of each policy to ``reference`` against the swept value.

    ``fmt`` (png, svg or pdf) defaults to the path's extension.

    :raises PlotUnavailableError: matplotlib is missing.
    """
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, series in ratios.items():
        axis.plot(values, series, marker="o", label=f"{name} / {reference}")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel(parameter)
    axis.set_ylabel(f"average ACT ratio to {reference}")
    axis.set_title(title)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    _save(plt, figure, path, fmt)


# -- the `tangram simulate` and `tangram trace generate` commands ------------------------

DEFAULT_POLICIES = "tangram,static,fixed-dop-4,bound"


def _policies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one policy")
    try:
        return [parse_policy(name) for name in names]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _assignments(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        kind, sep, value = part.partition("=")
        if not sep or not kind.strip():
            raise argparse.ArgumentTypeError(f"expected KIND=NUMBER (got {part!r})")
        out[kind.strip()] = _non_negative(value)
    return out


def _static_units(text: str) -> int | dict[str, int]:
    if "=" not in text:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})")
        return int(text)
    units = _assignments(text)
    if any(v != int(v) or v < 1 for v in units.values()):
        raise argparse.ArgumentTypeError(f"slot units must be whole numbers >= 1 ({text!r})")
    return {kind: int(v) for kind, v in units.items()}


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite (got {text!r})")
    return value


def _sweep(text: str) -> tuple[str, list[float]]:
    parameter, sep, values = text.partition("=")
    if not sep or not (parameter.startswith("capacity.") or parameter == "static-units"):
        raise argparse.ArgumentTypeError(
            f"expected capacity.KIND=V1,V2,... or static-units=V1,V2,... (got {text!r})"
        )
    try:
        numbers = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sweep values must be numbers (got {values!r})") from None
    if not numbers or any(not (math.isfinite(v) and v > 0) for v in numbers):
        raise argparse.ArgumentTypeError(f"sweep values must be > 0 (got {values!r})")
    if parameter == "static-units" and any(v != int(v) for v in numbers):
        raise argparse.ArgumentTypeError("static-units values must be whole")
    return parameter, numbers


def add_commands(commands: Any) -> None:
    """Add ``simulate`` and ``trace generate`` to the ``tangram`` command's subparsers."""
    sim = commands.add_parser(
        "simulate",
        help="replay a trace under tangram and the baselines in virtual time",
        description=(
            "Replays a tangram-trace/1 file under each policy on the same capacity and "
            "prints ACT statistics and the resource bill per policy."
        ),
    )
    sim.add_argument(
        "--trace",
        type=input_file,
        required=True,
        metavar="PATH",
        help="a tangram-trace/1 file; - reads standard input",
    )
    sim.add_argument(
        "--policy",
        type=_policies,
        default=_policies(DEFAULT_POLICIES),
        help=(f"comma-separated, of: {', '.join(POLICIES)} (default {DEFAULT_POLICIES})"),
    )
    sim.add_argument(
        "--capacity",
        type=_assignments,
        action="append",
        default=[],
        help="override the header's capacity, e.g. cpu=3840 (repeatable, or comma-separated)",
    )
    sim.add_argument(
        "--static-units",
        type=_static_units,
        default=None,
        help="units per static slot: N for every held kind, or cpu=4,gpu=1",
    )
    sim.add_argument(
        "--k8s-lag",
        type=_non_negative,
        default=60.0,
        help="seconds a k8s pod resize takes to take effect (default 60)",
    )
    sim.add_argument(
        "--json",
        type=output_file,
        metavar="PATH",
        help="write the result JSON here; - writes it to standard output (the table to stderr)",
    )
    sim.add_argument(
        "--plot",
        type=plot_file,
        metavar="PATH",
        help=(
            "write the ACT distributions (or the sweep) here, as .png, .svg or .pdf by the "
            "extension; - writes a PNG to standard output (the table to stderr)"
        ),
    )
    sim.add_argument(
        "--sweep",
        type=_sweep,
        help="run once per value, e.g. capacity.cpu=64,128,256 or static-units=1,2,4",
    )

    trace = commands.add_parser("trace", help="work with tangram-trace/1 files")
    sub = trace.add_subparsers(dest="trace_command", required=True)
    gen = sub.add_parser(
        "generate",
        help="write a synthetic trace shaped after one of the paper's workloads, or a family",
        description=(
            "Writes a deterministic synthetic trace (docs: simulate.md), or members of the "
            "seeded trace family that benchmarks/policy_family.py judges policies on."
        ),
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=WORKLOADS, help="the paper's workload to imitate")
    source.add_argument(
        "--family",
        action="store_true",
        help="members of the trace family of --seed (one with --member, else --members of them)",
    )
    gen.add_argument(
        "--batch", type=_at_least_one, help="trajectories in the step (needed with --workload)"
    )
    gen.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    gen.add_argument(
        "--member", type=_non_negative_int, metavar="I", help="--family: member I alone"
    )
    gen.add_argument(
        "--members",
        type=_at_least_one,
        metavar="N",
        help="--family: members 0..N-1, one file each in --out-dir (default 64)",
    )
    gen.add_argument(
        "--max-trajectories",
        type=_at_least_one,
        metavar="N",
        help="--family: cap each member's trajectories, keeping the rest it drew (default 4096)",
    )
    gen.add_argument(
        "--out-dir",
        type=output_dir,
        metavar="DIR",
        help="--family: write each member to DIR/NAME.jsonl (created if missing)",
    )
    gen.add_argument("--turns", type=_at_least_one, default=None, help="actions per trajectory")
    gen.add_argument(
        "--pareto-burst",
        action="store_true",
        help="Pareto action sizes and every trajectory's first action at time 0",
    )
    gen.add_argument(
        "--contended",
        action="store_true",
        help=(
            "less capacity than demand: coding a Pareto burst at 0.3 cores per trajectory, "
            "deepsearch the search API at half its demand, mopd 10 GPUs, one request a replica"
        ),
    )
    gen.add_argument(
        "--out",
        type=output_file,
        metavar="PATH",
        help="write here instead of standard output (- is stdout)",
    )


_WORKLOAD_ONLY = ("turns", "pareto_burst", "contended")
_FAMILY_ONLY = ("member", "members", "out_dir", "max_trajectories")


def check_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flag combinations of ``trace generate`` that would be silently ignored.

    argparse cannot say "needed with --workload" or "only with --family"; a flag that does
    nothing would let a user believe the file is what they asked for.
    """
    if args.command != "trace" or args.trace_command != "generate":
        return
    given = {
        name
        for name in (*_WORKLOAD_ONLY, *_FAMILY_ONLY)
        # `is`, not `in (None, False)`: member 0 equals False.
        if getattr(args, name) is not None and getattr(args, name) is not False
    }
    if args.workload is not None:
        if args.batch is None:
            parser.error("trace generate --workload needs --batch N")
        if given & set(_FAMILY_ONLY):
            parser.error("--member, --members, --max-trajectories and --out-dir go with --family")
        return
    if args.batch is not None or given & set(_WORKLOAD_ONLY):
        parser.error("--batch, --turns, --pareto-burst and --contended go with --workload")
    if args.member is not None:
        if args.members is not None or args.out_dir is not None:
            parser.error("--member writes one trace to --out; --members and --out-dir go alone")
    elif args.out_dir is None:
        parser.error("trace generate --family needs --member I (one trace) or --out-dir DIR")
    elif args.out is not None:
        parser.error("--out writes one trace (with --member); the family goes to --out-dir")


def _whole_from(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {value})")
        return value

    return parse


_non_negative_int = _whole_from(0)
_at_least_one = _whole_from(1)


def dispatch(args: argparse.Namespace) -> int | None:
    """Run ``args`` if they name one of these commands; ``None`` if they do not.

    :raises TangramError: a malformed trace or a capacity the trace's actions exceed.
    """
    if args.command == "trace" and args.trace_command == "generate" and args.family:
        return _family_command(args)
    if args.command == "trace" and args.trace_command == "generate":
        config = GenerateConfig(
            workload=args.workload,
            batch=args.batch,
            seed=args.seed,
            turns=args.turns,
            pareto_burst=args.pareto_burst,
            contended=args.contended,
        )
        if args.out in (None, STDIO):
            sys.stdout.writelines(generate_lines(config))
        else:
            with open(args.out, "w", encoding="utf-8", newline="\n") as handle:
                handle.writelines(generate_lines(config))
        return 0
    if args.command == "simulate":
        return _simulate_command(args)
    return None


def _family_command(args: argparse.Namespace) -> int:
    cap = 4096 if args.max_trajectories is None else args.max_trajectories
    if args.member is not None:
        lines = member(args.seed, args.member, max_trajectories=cap).lines
        if args.out in (None, STDIO):
            sys.stdout.writelines(lines)
        else:
            with open(args.out, "w", encoding="utf-8", newline="\n") as handle:
                handle.writelines(lines)
        return 0
    count = 64 if args.members is None else args.members
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        drawn = member(args.seed, index, max_trajectories=cap)
        path = args.out_dir / f"{drawn.name}.jsonl"
        with open(path, "w", encoding="utf-8", newline="\n") as handle:
            handle.writelines(drawn.lines)
        # The names say each member's class; the count shows progress on a long write.
        print(path, file=sys.stderr)
    return 0


def _simulate_command(args: argparse.Namespace) -> int:
    if args.trace == STDIO:
        where = "<stdin>"
        trace = read_lines(sys.stdin.buffer, where)
    else:
        where = str(args.trace)
        trace = read_trace(args.trace)
    if not trace.actions:
        raise TraceFormatError("the trace has no actions: nothing to simulate", path=where)
    overrides: dict[str, float] = {}
    for part in args.capacity:
        overrides.update(part)
    named = list(overrides)
    if args.sweep is not None and args.sweep[0].startswith("capacity."):
        named.append(args.sweep[0].removeprefix("capacity."))
    for kind in named:
        if kind not in trace.capacity:
            # A typo (`cpus`, `CPU`) would leave the header's capacity in place, unsaid.
            raise UnknownResourceError(
                f"capacity {kind!r} is not the trace's (it has: {', '.join(trace.capacity)})"
            )
    policies: list[str] = list(dict.fromkeys(args.policy))
    title = f"{trace.name or Path(where).name}: {len(trace.trajectories)} trajectories"
    # Whatever goes to standard output is the result; the table then goes beside it.
    shown = sys.stderr if STDIO in (args.json, args.plot) else sys.stdout
    if args.sweep is None:
        results = {
            name: run_policy(
                name, trace, overrides, static_units=args.static_units, k8s_lag=args.k8s_lag
            )
            for name in policies
        }
        summaries = {name: summarise(result) for name, result in results.items()}
        capacity = _capacity_text(trace, overrides)
        print(f"{title}, {trace.actions} actions, capacity {capacity}", file=shown)
        print(table(summaries), file=shown)
        document: dict[str, Any] = {"trace": trace.name, "policies": summaries}
        if args.plot is not None:
            plot_acts(results, title, *_plot_target(args.plot))
    else:
        document = _sweep_command(args, trace, overrides, policies, title, shown)
    if args.json == STDIO:
        sys.stdout.write(to_json(document))
    elif args.json is not None:
        args.json.write_text(to_json(document), encoding="utf-8")
    return 0


def _plot_target(plot: Path | str) -> tuple[Path | IO[bytes], str]:
    if plot == STDIO:
        sys.stdout.flush()
        return sys.stdout.buffer, "png"
    return Path(plot), plot_format(plot)


def _sweep_command(
    args: argparse.Namespace,
    trace: Trace,
    overrides: Mapping[str, float],
    policies: list[str],
    title: str,
    shown: IO[str],
) -> dict[str, Any]:
    parameter, values = args.sweep
    reference = "tangram" if "tangram" in policies else policies[0]
    points: list[dict[str, Any]] = []
    ratios: dict[str, list[float]] = {name: [] for name in policies if name != reference}
    for value in values:
        point_overrides = dict(overrides)
        static_units = args.static_units
        if parameter == "static-units":
            static_units = int(value)
        else:
            point_overrides[parameter.removeprefix("capacity.")] = value
        summaries = {
            name: summarise(
                run_policy(
                    name, trace, point_overrides, static_units=static_units, k8s_lag=args.k8s_lag
                )
            )
            for name in policies
        }
        print(f"{title}, {parameter} = {value:g}", file=shown)
        print(table(summaries), file=shown)
        print(file=shown)
        base = summaries[reference]["avg_act"]
        for name in ratios:
            ratios[name].append(_round(summaries[name]["avg_act"] / base) if base else math.nan)
        points.append({"value": value, "policies": summaries})
    if args.plot is not None:
        plot_sweep(parameter, values, ratios, reference, title, *_plot_target(args.plot))
    return {
        "trace": trace.name,
        "sweep": {
            "parameter": parameter,
            "values": values,
            "reference": reference,
            "avg_act_ratio": ratios,
            "points": points,
        },
    }


def _capacity_text(trace: Trace, overrides: Mapping[str, float]) -> str:
    merged = {**trace.capacity, **overrides}
    return ", ".join(f"{kind}={value:g}" for kind, value in sorted(merged.items()))
