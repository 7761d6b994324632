"""A seeded family of tangram-trace/1 workloads drawn from wide parameter ranges (issue #28).

The three generators of ``_generate.py`` are each tuned to one figure of the paper; a policy
tuned against them can win there and lose on a workload nobody generated. A family draws
many members from ranges wide enough to hold the shapes a real rollout might take (light
to very heavy tails, bursts and spread arrivals, CPU, GPU-service and API actions alone and
mixed, contended to roomy capacity), so a policy can be judged on its *worst* member.

Every member is a whole trace (its lines, header first) plus the parameters drawn for it.
Draws are deterministic: one :class:`random.Random` per member, seeded from the family's
seed and the member's index, draws in a fixed order, floats rounded to 4 decimals as
``_generate.py`` does, so a seed gives byte-identical lines. The member-level parameters are
all drawn before any trajectory, and trajectory ``t`` draws only after trajectories
``0..t-1``: capping the trajectory count (``max_trajectories``) keeps a member's shape and
its first trajectories' lines, and changes only what is derived from the whole batch (its
capacities, which follow the offered load).

Classes are stratified by index rather than drawn, so any 24 consecutive members hold every
combination of resource mix (:data:`MIXES`), size tail (:data:`TAILS`) and arrival
(:data:`ARRIVALS`), and 60 members hold each at least twice.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._core._validate import whole
from ..errors import SettingTypeError
from ._trace import FORMAT, Trace, read_lines

__all__ = ["ARRIVALS", "MIXES", "RANGES", "TAILS", "Member", "family", "member"]

MIXES = ("cpu", "gpu", "api", "mixed")
"""Which kinds a member's actions use: one alone, or two or three of them (``mixed``)."""
TAILS = ("lognormal", "pareto", "bimodal")
"""How action sizes spread around their median: light (lognormal), heavy (Pareto), or a
mix of short and long actions (bimodal)."""
ARRIVALS = ("burst", "spread")
"""Every trajectory's first action at t=0, or the first actions spread over 0..S seconds."""

RANGES: Mapping[str, tuple[float, float]] = {
    # The ranges.
    "trajectories": (64, 4096),  # log-uniform
    "pareto_alpha": (1.1, 3.0),  # below 2 the variance is infinite
    "gpus": (2, 40),  # log-uniform
    "services": (2, 12),
    "restore_seconds": (0.2, 10.0),  # log-uniform
    "api_factor": (0.5, 2.0),  # API rate over the offered request rate
    "cpu_factor": (0.2, 2.0),  # log-uniform; cores over the offered CPU load
    # Guesses wide enough to hold the three paper-shaped workloads and more.
    "lognormal_sigma": (0.25, 2.0),
    "long_share": (0.02, 0.3),
    "long_ratio": (5.0, 100.0),  # log-uniform
    "spread_seconds": (5.0, 1200.0),  # log-uniform
    "turns_mean": (1.0, 24.0),  # log-uniform
    "gap_median": (0.5, 30.0),  # log-uniform
    "gap_sigma": (0.2, 1.2),
    "zipf": (0.3, 2.0),
    "concurrency_factor": (0.5, 2.0),
    "rigid_seconds": (0.2, 5.0),  # log-uniform medians
    "elastic_seconds": (2.0, 60.0),
    "gpu_seconds": (0.1, 5.0),
    "api_seconds": (0.2, 5.0),
}
"""Where each drawn parameter lies (both ends included)."""

# No action longer than this many times its kind's median: a Pareto tail of alpha 1.1 over
# 10^5 actions would otherwise draw a few actions of days, which decide the step's length
# alone and say nothing about a policy. About 0.2% of actions are cut at alpha 1.1.
SIZE_CAP = 1000.0
# Smallest action: a duration that rounds to 0 would be an action that takes no time.
MIN_SECONDS = 0.001
# The API kind's name; any name that is not a held kind would do.
API_KIND = "search_api"
# The subsets a ``mixed`` member draws from; all three kinds twice as often as each pair.
_MIXED = (
    ("cpu", "gpu"),
    ("cpu", "api"),
    ("api", "gpu"),
    ("api", "cpu", "gpu"),
    ("api", "cpu", "gpu"),
)
_ELASTIC_MAX = (2, 4, 8, 16, 32)
_RIGID_MAX = (1, 1, 2, 4, 8)
_SERVICE_GPUS = (1, 1, 1, 2, 2, 4, 8)
_MAX_BATCH = (1, 2, 4, 8, 16, 32)
_MAX_SERVICES = int(RANGES["services"][1])


@attrs.frozen
class Member:
    """One workload of a family: its name, every parameter drawn, and the trace's lines."""

    name: str
    params: Mapping[str, Any] = attrs.field(hash=False)
    lines: tuple[str, ...]

    def trace(self) -> Trace:
        """The member parsed, as :func:`tangram.read_trace` reads a file of these lines."""
        return read_lines(self.lines, self.name)

    @property
    def kinds(self) -> frozenset[str]:
        """The kinds its actions use (``cpu``, ``gpu``, ``api``): every one is present once
        the member has as many trajectories as kinds."""
        return frozenset(self.params["kinds"])


def family(seed: int = 0, members: int = 64, *, max_trajectories: int = 4096) -> tuple[Member, ...]:
    """``members`` workloads drawn from :data:`RANGES`, members ``0..members-1`` of ``seed``.

    ``max_trajectories`` caps each member's trajectory count (a quick benchmark takes 256)
    without changing anything else drawn.

    :raises InvalidSettingError: ``members`` or ``max_trajectories`` below 1 (a
        ``SettingTypeError`` for a value that is not a whole number).
    """
    whole("members", members, minimum=1)
    return tuple(member(seed, i, max_trajectories=max_trajectories) for i in range(members))


def member(seed: int, index: int, *, max_trajectories: int = 4096) -> Member:
    """Member ``index`` of family ``seed`` alone: the same as ``family(seed, ...)[index]``.

    :raises InvalidSettingError: ``index`` below 0 or ``max_trajectories`` below 1.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SettingTypeError(f"`seed` must be a whole number (got {seed!r})")
    whole("index", index)
    whole("max_trajectories", max_trajectories, minimum=1)
    # A string seed is hashed with SHA-512 by random.Random: stable across runs and
    # platforms, and (seed, index) pairs never collide as seed * K + index could.
    rng = random.Random(f"tangram-family/{seed}/{index}")
    params = _draw(rng, index, max_trajectories)
    return _Builder(rng, params).member(seed, index)


def _r(value: float) -> float:
    return round(value, 4)


def _uniform(rng: random.Random, key: str) -> float:
    low, high = RANGES[key]
    return _r(rng.uniform(low, high))


def _log_uniform(rng: random.Random, key: str) -> float:
    low, high = RANGES[key]
    return _r(math.exp(rng.uniform(math.log(low), math.log(high))))


def _draw(rng: random.Random, index: int, cap: int) -> dict[str, Any]:
    """Every member-level parameter, in a fixed order whatever the class: the draws a class
    does not use are made anyway, so the stream stays aligned across classes."""
    mix = MIXES[index % len(MIXES)]
    tail = TAILS[index // len(MIXES) % len(TAILS)]
    arrival = ARRIVALS[index // (len(MIXES) * len(TAILS)) % len(ARRIVALS)]
    low, high = RANGES["trajectories"]
    drawn = round(math.exp(rng.uniform(math.log(low), math.log(high))))
    p: dict[str, Any] = {
        "mix": mix,
        "tail": tail,
        "arrival": arrival,
        "trajectories": min(drawn, cap),
        "trajectories_drawn": drawn,
        "turns_mean": _log_uniform(rng, "turns_mean"),
        "turns_dist": rng.choice(("fixed", "geometric")),
        "gap_median": _log_uniform(rng, "gap_median"),
        "gap_sigma": _uniform(rng, "gap_sigma"),
    }
    spread = _log_uniform(rng, "spread_seconds")
    shape = {
        "lognormal_sigma": _uniform(rng, "lognormal_sigma"),
        "pareto_alpha": _uniform(rng, "pareto_alpha"),
        "long_share": _uniform(rng, "long_share"),
        "long_ratio": _log_uniform(rng, "long_ratio"),
    }
    subset = rng.choice(_MIXED)
    shares = [rng.expovariate(1.0) for _ in range(3)]
    cpu = {
        "cpu_factor": _log_uniform(rng, "cpu_factor"),
        "elastic_share": _r(rng.choice((0.0, 1.0, rng.random()))),
        "elastic_max": rng.choice(_ELASTIC_MAX),
        "elastic_min": rng.choice((1, 1, 2)),
        "parallel_fraction_low": _r(rng.uniform(0.5, 0.95)),
        "parallel_fraction_high": 0.0,
        "rigid_units_max": rng.choice(_RIGID_MAX),
        "rigid_seconds": _log_uniform(rng, "rigid_seconds"),
        "elastic_seconds": _log_uniform(rng, "elastic_seconds"),
    }
    cpu["parallel_fraction_high"] = _r(cpu["parallel_fraction_low"] + rng.uniform(0.0, 0.049))
    gpus = round(_log_uniform(rng, "gpus"))
    services = rng.randint(int(RANGES["services"][0]), _MAX_SERVICES)
    specs = [_service(rng, gpus) for _ in range(_MAX_SERVICES)]
    gpu = {
        "gpus": gpus,
        "services": services,
        "zipf": _uniform(rng, "zipf"),
        "gpu_seconds": _log_uniform(rng, "gpu_seconds"),
        "service_specs": {f"svc{k}": spec for k, spec in enumerate(specs[:services])},
    }
    api = {
        "api_kind": API_KIND,
        "api_factor": _uniform(rng, "api_factor"),
        "api_seconds": _log_uniform(rng, "api_seconds"),
        "concurrency_factor": _uniform(rng, "concurrency_factor"),
    }
    if rng.random() < 0.5:
        api["concurrency_factor"] = None
    # Only what the member's classes use goes into its parameters.
    if arrival == "spread":
        p["spread_seconds"] = spread
    if tail == "lognormal":
        p["lognormal_sigma"] = shape["lognormal_sigma"]
    elif tail == "pareto":
        p["pareto_alpha"] = shape["pareto_alpha"]
    else:
        p["long_share"], p["long_ratio"] = shape["long_share"], shape["long_ratio"]
    kinds = subset if mix == "mixed" else (mix,)
    p["kinds"] = list(kinds)
    if len(kinds) > 1:
        # Each kind's share of the turns: no kind below 10%, so a mixed member is mixed.
        raw = {k: shares[i] for i, k in enumerate(("api", "cpu", "gpu")) if k in kinds}
        floored = {k: max(0.1, v / sum(raw.values())) for k, v in raw.items()}
        p["weights"] = {k: _r(v / sum(floored.values())) for k, v in floored.items()}
    for kind, group in (("cpu", cpu), ("gpu", gpu), ("api", api)):
        if kind in kinds:
            p.update(group)
    return p


def _service(rng: random.Random, gpus: int) -> dict[str, Any]:
    """One GPU model service that fits the member's ``gpus``: a replica's devices and its
    memory on each (at most a device's 80 GiB) never exceed what exists."""
    size = rng.choice([g for g in _SERVICE_GPUS if g <= gpus])
    restore = _log_uniform(rng, "restore_seconds")
    return {
        "gpus": size,
        "gpu_mem_gib": size * rng.randint(8, 80),
        "restore_seconds": restore,
        "cold_start_seconds": _r(restore * rng.uniform(5.0, 20.0)),
        "max_batch": rng.choice(_MAX_BATCH),
    }


def _busy_mean(intervals: Sequence[tuple[float, float, float]]) -> float:
    """The load an average unit of demand meets: the integral of h^2 over that of h, where h
    is the summed height of the ``(start, end, height)`` intervals. Unlike the mean over
    the whole step, it is not diluted by a long tail where one trajectory is left."""
    edges = sorted(
        [(start, height) for start, _, height in intervals]
        + [(end, -height) for _, end, height in intervals]
    )
    first = second = height = 0.0
    last = 0.0
    for at, delta in edges:
        span = at - last
        first += height * span
        second += height * height * span
        height += delta
        last = at
    return second / first if first > 0 else 0.0


class _Builder:
    """The trajectories of one member, and the capacities that follow from their load."""

    def __init__(self, rng: random.Random, params: dict[str, Any]) -> None:
        self.rng = rng
        self.p = params
        self.cpu: list[tuple[float, float, float]] = []  # cores held at min width
        self.gpu: list[tuple[float, float, float]] = []
        self.slots: list[tuple[float, float, float]] = []  # API connections held
        self.calls: list[tuple[float, float, float]] = []  # per trajectory: its call rate
        self.widest = 1  # the most cores one CPU action may hold

    def size(self, median: float) -> float:
        """An action's duration around ``median``, with the member's tail."""
        p, rng = self.p, self.rng
        if p["tail"] == "lognormal":
            value = median * math.exp(p["lognormal_sigma"] * rng.gauss(0.0, 1.0))
        elif p["tail"] == "pareto":
            alpha = p["pareto_alpha"]
            # The median is kept: Pareto median = xm * 2^(1/alpha).
            value = median / 2 ** (1 / alpha) * rng.paretovariate(alpha)
        else:
            jitter = math.exp(0.25 * rng.gauss(0.0, 1.0))
            long = rng.random() < p["long_share"]
            value = median * jitter * (p["long_ratio"] if long else 1.0)
        return max(MIN_SECONDS, _r(min(value, SIZE_CAP * median)))

    def gap(self) -> float:
        p = self.p
        return _r(p["gap_median"] * math.exp(p["gap_sigma"] * self.rng.gauss(0.0, 1.0)))

    def turns(self) -> int:
        mean = float(self.p["turns_mean"])
        if self.p["turns_dist"] == "fixed":
            return max(1, round(mean))
        count = 1
        while count < 4 * mean and self.rng.random() > 1 / mean:
            count += 1
        return count

    def trajectory(self, t: int) -> list[dict[str, Any]]:
        p, rng = self.p, self.rng
        name = f"t{t:05d}"
        kinds: list[str] = p["kinds"]
        specs: dict[str, dict[str, Any]] = p.get("service_specs", {})
        home = None
        if specs:
            # A trajectory's task decides its judge or teacher: one service per trajectory,
            # of Zipf popularity.
            weights = [1 / (rank + 1) ** p["zipf"] for rank in range(len(specs))]
            home = f"svc{rng.choices(range(len(specs)), weights=weights)[0]}"
        first = 0.0 if p["arrival"] == "burst" else _r(rng.uniform(0.0, p["spread_seconds"]))
        clock = 0.0
        lines: list[dict[str, Any]] = []
        for index in range(self.turns()):
            gap = first if index == 0 else self.gap()
            kind = kinds[0]
            if len(kinds) > 1:
                kind = rng.choices(kinds, weights=[p["weights"][k] for k in kinds])[0]
                if index == 0 and t < len(kinds):
                    kind = kinds[t]  # every kind present once there are enough trajectories
            line: dict[str, Any] = {"trajectory": name, "index": index, "gap": gap}
            arrive = clock + gap
            if kind == "cpu":
                seconds = self._cpu(line, arrive)
            elif kind == "gpu":
                assert home is not None
                gpus = specs[home]["gpus"]
                seconds = self.size(p["gpu_seconds"])
                line.update(kind=home, resource="gpu", units=gpus, seconds=seconds, service=home)
                self.gpu.append((arrive, arrive + seconds, gpus))
            else:
                seconds = self.size(p["api_seconds"])
                line.update(kind="search", resource=p["api_kind"], units=1, seconds=seconds)
                self.slots.append((arrive, arrive + seconds, 1.0))
            clock = arrive + seconds
            lines.append(line)
        calls = sum(1 for line in lines if line["resource"] == p.get("api_kind"))
        if calls:
            self.calls.append((first, clock, calls / max(clock - first, MIN_SECONDS)))
        return lines

    def _cpu(self, line: dict[str, Any], arrive: float) -> float:
        """Fill a CPU action's fields; its seconds at its minimum width (the unqueued
        schedule the offered load is measured on)."""
        p, rng = self.p, self.rng
        seconds: float
        if rng.random() < p["elastic_share"]:
            low, high = min(p["elastic_min"], p["elastic_max"]), p["elastic_max"]
            fraction = _r(rng.uniform(p["parallel_fraction_low"], p["parallel_fraction_high"]))
            work = self.size(p["elastic_seconds"])
            line.update(kind="run_tests", resource="cpu", min=low, max=high, seconds_at_1=work)
            line["efficiency"] = {"model": "amdahl", "parallel_fraction": fraction}
            seconds = work * ((1 - fraction) + fraction / low)
        else:
            low = high = rng.choice([u for u in (1, 2, 4, 8) if u <= p["rigid_units_max"]])
            seconds = self.size(p["rigid_seconds"])
            line.update(kind="shell", resource="cpu", units=low, seconds=seconds)
        self.widest = max(self.widest, high)
        self.cpu.append((arrive, arrive + seconds, float(low)))
        return seconds

    def capacity(self) -> tuple[dict[str, float], dict[str, float]]:
        """The header's capacity, and the offered loads it was sized on."""
        p = self.p
        capacity: dict[str, float] = {}
        offered: dict[str, float] = {}
        if "cpu" in p["kinds"]:
            offered["cpu"] = _r(_busy_mean(self.cpu))
            # Never below the widest action: every member is servable.
            capacity["cpu"] = max(self.widest, math.ceil(p["cpu_factor"] * offered["cpu"]))
        if "gpu" in p["kinds"]:
            offered["gpu"] = _r(_busy_mean(self.gpu))
            capacity["gpu"] = p["gpus"]
        if "api" in p["kinds"]:
            kind = p["api_kind"]
            offered["api_rate"] = _r(_busy_mean(self.calls))
            offered["api_concurrency"] = _r(_busy_mean(self.slots))
            # A rate must be > 0; 0.001 a second is as good as none for any step here.
            capacity[kind] = max(0.001, _r(p["api_factor"] * offered["api_rate"]))
            if p["concurrency_factor"] is not None:
                slots = math.ceil(p["concurrency_factor"] * offered["api_concurrency"])
                capacity[f"{kind}_concurrency"] = max(1, slots)
        return capacity, offered

    def member(self, seed: int, index: int) -> Member:
        p = self.p
        actions = [self.trajectory(t) for t in range(p["trajectories"])]
        capacity, offered = self.capacity()
        p["capacity"], p["offered"] = capacity, offered
        name = f"f{index:03d}-{p['mix']}-{_tail_tag(p)}-{_arrival_tag(p)}-n{p['trajectories']}"
        header: dict[str, Any] = {"format": FORMAT, "name": name, "capacity": capacity}
        if "service_specs" in p:
            header["services"] = p["service_specs"]
        header["generator"] = {"family": seed, "member": index, **p}
        lines = [json.dumps(header, sort_keys=True) + "\n"]
        for trajectory in actions:
            lines.extend(json.dumps(line, separators=(", ", ": ")) + "\n" for line in trajectory)
        return Member(name=name, params=p, lines=tuple(lines))


def _tail_tag(p: Mapping[str, Any]) -> str:
    if p["tail"] == "lognormal":
        return f"lognorm{p['lognormal_sigma']:.2f}"
    if p["tail"] == "pareto":
        return f"pareto{p['pareto_alpha']:.2f}"
    return f"bimodal{p['long_share']:.2f}x{p['long_ratio']:.0f}"


def _arrival_tag(p: Mapping[str, Any]) -> str:
    return "burst" if p["arrival"] == "burst" else f"spread{p['spread_seconds']:.0f}"
