"""Synthetic tangram-trace/1 workloads shaped after the paper's three evaluations.

No rollout traces were published with the paper, so the simulator and the baselines need
workloads whose *shape* matches what it reports: a coding sandbox busy about 47% of a
trajectory's life with elastic builds and tests, a search agent whose calls hit a rate- and
concurrency-limited API and end in a GPU judge, and on-policy distillation against nine
teachers of skewed popularity. Every number below is a documented guess anchored on a
figure of the ARL-Tangram paper (see docs/simulate.md, "Distributions"); the traces are
for comparing policies on the same input, not for predicting a real cluster.

Output is deterministic: one :class:`random.Random` seeded by the caller, draws in a fixed
order, floats rounded, keys in a fixed order, so a seed gives byte-identical files.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from typing import Any, Literal

import attrs

from .._core._validate import number, whole
from ..errors import InvalidSettingError
from ._trace import FORMAT

__all__ = ["WORKLOADS", "GenerateConfig", "generate", "generate_lines"]

Workload = Literal["coding", "deepsearch", "mopd"]
WORKLOADS: tuple[Workload, ...] = ("coding", "deepsearch", "mopd")

# Pareto shape of --pareto-burst sizes: below 2 the variance is infinite, which is the
# point (a few huge actions behind which FCFS stalls); above 1 the mean stays finite.
PARETO_ALPHA = 1.5

# Requests one model-service replica serves at once (continuous batching in vLLM or
# SGLang): a guess on the low side for judging prompts of a few thousand tokens.
MAX_BATCH = 8

# Cores per trajectory of the contended coding variant: a heavy-tailed burst on well under
# one core each, where the order of admission decides most of the average ACT.
CONTENDED_CORES = 0.3

# Share of the search API's demand the contended deepsearch variant provides. Over the
# first 30 s, where most calls fall, a trajectory asks 0.135 calls a second (0.12-0.19 in
# 5 s windows, measured on generated traces with no queueing), holding a connection
# 1.5 s each: ``0.135 * batch`` calls a second and ``0.2 * batch`` connections meet it.
CONTENDED_API = 0.5

# Scoring chunks one teacher replica serves at once. Teacher scoring is prefill only (the
# student's tokens are given), which an inference server batches far wider than decoding
# (vLLM's default max_num_seqs is 256). Anchored on the paper's MOPD-2048 breakdown, 0.081 s
# of queueing at ~10 GPUs: with 8, a replica was the bottleneck and the same trace queued
# 14.9 s on average at 10 GPUs; with 32 it queues 0.07 s there.
TEACHER_BATCH = 32


def _workload(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in WORKLOADS:
        raise InvalidSettingError(
            f"`workload` must be one of {', '.join(WORKLOADS)} (got {value!r})"
        )


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    number(attribute.name, value, strict=True)


def _at_least_one(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    whole(attribute.name, value, minimum=1)


@attrs.frozen(kw_only=True)
class GenerateConfig:
    """What to generate. ``turns`` is actions per trajectory (coding) or search calls
    (deepsearch) or scoring chunks (mopd); ``None`` takes the workload's default.
    ``zipf``: the exponent of the teachers' popularity (mopd).

    :raises InvalidSettingError: an unknown workload, a batch or turn count below 1, or a
        Zipf exponent that is not > 0 (a ``SettingTypeError`` for a value of the wrong type).
    """

    workload: str = attrs.field(validator=_workload)
    batch: int = attrs.field(validator=_at_least_one)
    seed: int = 0
    turns: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_at_least_one),
    )
    pareto_burst: bool = False
    contended: bool = False
    zipf: float = attrs.field(default=1.1, validator=_positive)


def _r(value: float) -> float:
    # Four decimals (0.1 ms) keep files small and the text independent of float repr
    # subtleties; no duration in these workloads is shorter than a few milliseconds.
    return round(value, 4)


class _Sizes:
    """Heavy-tailed action durations: lognormal by default, Pareto under --pareto-burst.

    The Pareto draw keeps the lognormal's median, so the two variants differ in the tail
    only (Pareto median = xm * 2^(1/alpha)).
    """

    def __init__(self, rng: random.Random, pareto: bool) -> None:
        self.rng = rng
        self.pareto = pareto

    def __call__(self, median: float, sigma: float) -> float:
        if self.pareto:
            xm = median / 2 ** (1 / PARETO_ALPHA)
            return xm * self.rng.paretovariate(PARETO_ALPHA)
        return median * math.exp(sigma * self.rng.gauss(0.0, 1.0))


def _gap(rng: random.Random, median: float, sigma: float = 0.6) -> float:
    """LLM generation time between actions: lognormal, as decode lengths are."""
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _name(config: GenerateConfig) -> str:
    suffix = "-pareto-burst" if config.pareto_burst else ""
    if config.contended:
        suffix += "-contended"
    return f"{config.workload}-{config.batch}{suffix}"


def _coding(config: GenerateConfig, rng: random.Random) -> tuple[dict[str, Any], Iterator[Any]]:
    # One core per trajectory by default: the per-trajectory sandbox frameworks reserve.
    # Contended: a Pareto burst on CONTENDED_CORES per trajectory.
    burst = config.pareto_burst or config.contended
    cores = max(1, round(CONTENDED_CORES * config.batch)) if config.contended else config.batch
    header: dict[str, Any] = {"capacity": {"cpu": cores}}
    turns = config.turns or 20
    size = _Sizes(rng, burst)

    def lines() -> Iterator[dict[str, Any]]:
        for t in range(config.batch):
            for index in range(turns):
                # First gap: the prompt's first generation; the burst variant issues every
                # trajectory's first action at once.
                gap = (0.0 if burst else _gap(rng, 6.0)) if index == 0 else _gap(rng, 3.7)
                draw = rng.random()
                line: dict[str, Any] = {"trajectory": f"t{t:05d}", "index": index, "gap": _r(gap)}
                if draw < 0.5:
                    # Shell commands (ls, cat, grep, edits): rigid, one core, sub-second.
                    line.update(kind="shell", resource="cpu", units=1)
                    line["seconds"] = _r(size(0.4, 0.8))
                elif draw < 0.85:
                    line.update(kind="run_tests", resource="cpu", min=1, max=16)
                    line["seconds_at_1"] = _r(size(4.0, 1.0))
                    fraction = 0.85 + 0.12 * rng.random()
                    line["efficiency"] = {"model": "amdahl", "parallel_fraction": _r(fraction)}
                else:
                    line.update(kind="build", resource="cpu", min=1, max=16)
                    line["seconds_at_1"] = _r(size(8.0, 0.8))
                    fraction = 0.9 + 0.08 * rng.random()
                    line["efficiency"] = {"model": "amdahl", "parallel_fraction": _r(fraction)}
                line["mem_gib"] = 2
                yield line

    return header, lines()


def _deepsearch(config: GenerateConfig, rng: random.Random) -> tuple[dict[str, Any], Iterator[Any]]:
    batch = config.batch
    # A search provider's quota: requests per second and open connections. A quarter of
    # the batch per second keeps the API the bottleneck it is in the paper's DeepSearch
    # runs, without making it the only thing that matters; contended, it meets half the
    # demand (CONTENDED_API).
    if config.contended:
        rate = max(2, round(CONTENDED_API * 0.135 * batch))
        connections = max(4, round(CONTENDED_API * 0.2 * batch))
    else:
        rate, connections = max(4, batch // 4), max(8, batch // 2)
    header: dict[str, Any] = {
        "capacity": {
            "search_api": rate,
            "search_api_concurrency": connections,
            "gpu": max(1, batch // 128),
        },
        "services": {
            "judge": {
                "gpus": 1,
                "gpu_mem_gib": 40,
                "restore_seconds": 1.5,
                "cold_start_seconds": 30,
                "max_batch": MAX_BATCH,
            }
        },
    }
    mean_calls = config.turns or 6
    size = _Sizes(rng, config.pareto_burst)

    def lines() -> Iterator[dict[str, Any]]:
        for t in range(batch):
            # Search calls per trajectory: 1 + geometric, mean ``mean_calls``.
            calls = 1
            while calls < 4 * mean_calls and rng.random() > 1 / mean_calls:
                calls += 1
            name = f"t{t:05d}"
            for index in range(calls):
                first = index == 0
                gap = 0.0 if first and config.pareto_burst else _gap(rng, 4.0 if first else 2.5)
                yield {
                    "trajectory": name,
                    "index": index,
                    "gap": _r(gap),
                    "kind": "search",
                    "resource": "search_api",
                    "units": 1,
                    "seconds": _r(size(1.2, 0.7)),
                }
            yield {
                "trajectory": name,
                "index": calls,
                "gap": _r(_gap(rng, 5.0)),
                "kind": "judge",
                "resource": "gpu",
                "units": 1,
                "seconds": _r(size(0.6, 0.5)),
                "service": "judge",
            }

    return header, lines()


def _zipf(rng: random.Random, weights: list[float]) -> int:
    return rng.choices(range(len(weights)), weights=weights)[0]


def _mopd(config: GenerateConfig, rng: random.Random) -> tuple[dict[str, Any], Iterator[Any]]:
    teachers = 9
    # Zipf, s = 1.1 by default: the most popular teacher gets ~36% of the trajectories,
    # the least ~4%.
    weights = [1 / (rank + 1) ** config.zipf for rank in range(teachers)]
    # Every teacher fits one GPU: the paper served all nine on ~10 GPUs at a latency
    # comparable to 4 GPUs each, which a teacher spanning two devices would rule out.
    # Contended: 10 GPUs, one request per replica at a time, restores spread over 2-4 s.
    contended = config.contended
    services = {
        f"teacher{rank}": {
            "gpus": 1,
            "gpu_mem_gib": 70,
            "restore_seconds": _r(2.0 + 2.0 * rank / (teachers - 1)) if contended else 2.0,
            "cold_start_seconds": 40,
            "max_batch": 1 if contended else TEACHER_BATCH,
        }
        for rank in range(teachers)
    }
    # The paper's baseline gives each teacher 4 GPUs (36); tangram served at ~10.
    gpus = 10 if contended else 16
    header: dict[str, Any] = {"capacity": {"gpu": gpus}, "services": services}
    chunks = config.turns or 3
    size = _Sizes(rng, config.pareto_burst)

    def lines() -> Iterator[dict[str, Any]]:
        for t in range(config.batch):
            teacher = _zipf(rng, weights)
            name = f"t{t:05d}"
            for index in range(chunks):
                first = index == 0
                gap = 0.0 if first and config.pareto_burst else _gap(rng, 20.0 if first else 6.0)
                yield {
                    "trajectory": name,
                    "index": index,
                    "gap": _r(gap),
                    "kind": f"teacher{teacher}",
                    "resource": "gpu",
                    "units": 1,
                    "seconds": _r(size(0.6, 0.5)),
                    "service": f"teacher{teacher}",
                }

    return header, lines()


_BUILDERS: dict[
    str, Callable[[GenerateConfig, random.Random], tuple[dict[str, Any], Iterator[Any]]]
] = {"coding": _coding, "deepsearch": _deepsearch, "mopd": _mopd}


def generate_lines(config: GenerateConfig) -> Iterator[str]:
    """The trace as lines of text (each ending in a newline), header first."""
    rng = random.Random(config.seed)
    body, actions = _BUILDERS[config.workload](config, rng)
    header = {"format": FORMAT, "name": _name(config), **body}
    generator = {
        "workload": config.workload,
        "batch": config.batch,
        "seed": config.seed,
        "pareto_burst": config.pareto_burst,
    }
    if config.contended:
        generator["contended"] = True
    if config.turns is not None:
        generator["turns"] = config.turns
    if config.zipf != 1.1:
        generator["zipf"] = config.zipf
    header["generator"] = generator
    yield json.dumps(header, sort_keys=True) + "\n"
    for line in actions:
        yield json.dumps(line, separators=(", ", ": ")) + "\n"


def generate(config: GenerateConfig) -> str:
    """The whole trace as one string; same config, same bytes."""
    return "".join(generate_lines(config))
