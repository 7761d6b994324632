"""Policy quality: ElasticPolicy against fixed degrees of parallelism, in simulation.

What it measures
    Seeded random rollout steps are replayed through ``tangram.simulate`` (the live
    runtime's ledger and policy on a virtual clock) under four policies: tangram's
    ``ElasticPolicy`` and the fixed-DoP baselines ``FcfsPolicy(dop="min")`` (one core
    each), ``FcfsPolicy(dop=4)`` and ``FcfsPolicy(dop="max")`` (all 16 an action may use).
    For each it reports the average and 95th-percentile action completion time (ACT =
    queueing + execution), the step duration (when the last trajectory ends) and the
    core-seconds billed (units held over time), each also as a ratio baseline / tangram,
    so above 1 means tangram is better (for unit-seconds: cheaper).

Why
    The paper's ablation compares elastic DoP with fixed DoP=4 and DoP=16: a fixed DoP
    either idles cores when load is light or queues actions when it is dense, and the
    right DoP changes from moment to moment within one step. An elastic policy is only
    worth its complexity if it beats *every* fixed choice on the objective it optimises,
    the sum (equivalently the average) of ACTs, so that is the target: the average-ACT
    ratio must be above 1 against each baseline in each scenario.

Workload
    Each trajectory issues a chain of actions, ``Elastic(1, 16, resizable=True)`` cores
    each, with an Amdahl efficiency (parallel fraction uniform in [0.6, 0.99]), a one-core
    time drawn from a Pareto distribution (shape 1.5, scale 2 s: heavy-tailed, as builds
    and test runs are) and an exponential gap (mean 3 s, the LLM's generation time) before
    each action. Kinds are drawn from three names so the online estimator has something
    to tell apart. Scenarios: *roomy* gives one core per trajectory, as a per-trajectory
    sandbox would; *congested* gives one core per four trajectories. Each runs with
    ``estimates="exact"`` (the policy knows each action's true model) and ``"learned"``
    (it relies on the online estimator, as a live runtime does).

Overload
    Replayed from traces of ``tangram trace generate`` with ``tangram simulate``'s
    policies (``run_policy``). *Heavy-tail burst*: the contended coding variant (Pareto
    sizes, every first action at once, 0.3 cores per trajectory), seeds 0-2; tangram's
    average ACT against ``srpt``'s (shortest first, no aging: the average to reach) and
    its p95 against ``tangram-fcfs``'s (first-come-first-served admission: the tail not
    to lose), ratios tangram / reference per seed, all in one run. The same on a size
    and a distribution the default was not chosen on (1000 trajectories; lognormal sizes
    without the burst), reported, not targeted. *Coding*: tangram's average ACT over
    the bound's at 1.125 cores per trajectory, and over ``tangram-fcfs``'s at 1 and 1.125
    (no worse than FCFS admission, i.e. than before). *GPU services under contention*:
    the contended MOPD variant (2,048 trajectories, nine teachers with Zipf popularity
    on 10 GPUs, ``max_batch`` 1, 2-4 s restores), seeds 0-2: tangram's average and p95
    ACT over ``pooled``'s (every request FCFS on any device with no restore: not
    reachable, a yardstick); the full run adds 1,024 and 4,096 trajectories and Zipf
    exponents 0.8 and 1.5, reported, not targeted. *API-bound deepsearch*: the contended
    deepsearch variant (search API at half its demand, the judge on ``batch / 128`` GPUs),
    seeds 0-2 at 256 trajectories (the quick run: one seed at 128): tangram's average
    ACT over ``static``'s and over the lowest of the ``fixed-dop-K`` baselines (K in
    ``DEEPSEARCH_DOPS``), per seed, the worst seed targeted below 1.

The last line of stdout is one JSON object (``"bench": "policy_quality"``) with every
figure and whether each target was met. The exit status is 0 whether or not targets are met.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import tangram
from tangram import Amdahl, Elastic, ElasticPolicy, FcfsPolicy, Step
from tangram._sim._baselines import run_policy
from tangram._sim._generate import GenerateConfig, generate_lines

Estimates = Literal["exact", "learned"]

POLICIES: dict[str, tangram.abc.Policy] = {
    "tangram": ElasticPolicy(),
    "fcfs_dop_min": FcfsPolicy(dop="min"),
    "fcfs_dop_4": FcfsPolicy(dop=4),
    "fcfs_dop_max": FcfsPolicy(dop="max"),
}
BASELINES = [name for name in POLICIES if name != "tangram"]
METRICS = ("avg_act", "p95_act", "step_seconds", "unit_seconds")
KINDS = ("build", "test", "lint")
MAX_CORES = 16


def workload(seed: int, trajectories: int, steps: int) -> dict[str, list[Step]]:
    """One seeded rollout step: ``trajectories`` chains of ``steps`` elastic actions."""
    rng = random.Random(seed)
    work: dict[str, list[Step]] = {}
    for t in range(trajectories):
        chain = []
        for _ in range(steps):
            chain.append(
                Step(
                    demand={"cpu": Elastic(1, MAX_CORES, resizable=True)},
                    seconds_at_1=rng.paretovariate(1.5) * 2.0,
                    efficiency=Amdahl(rng.uniform(0.6, 0.99)),
                    gap=rng.expovariate(1 / 3.0),
                    kind=rng.choice(KINDS),
                )
            )
        work[f"t{t:04d}"] = chain
    return work


def _run(
    work: Mapping[str, Sequence[Step]], cores: int, policy: tangram.abc.Policy, estimates: Estimates
) -> dict[str, float]:
    started = time.perf_counter()
    result = tangram.simulate(work, {"cpu": cores}, policy=policy, estimates=estimates)
    return {
        "avg_act": result.avg_act,
        "p95_act": result.act_quantile(0.95),
        "step_seconds": result.step_seconds,
        "unit_seconds": result.unit_seconds["cpu"],
        "simulate_seconds": time.perf_counter() - started,
    }


def _geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def scenario(
    name: str, cores: int, estimates: Estimates, seeds: Sequence[int], trajectories: int, steps: int
) -> dict[str, Any]:
    """Every policy on every seed; means per policy and per-seed ratios baseline/tangram."""
    runs: dict[str, list[dict[str, float]]] = {policy: [] for policy in POLICIES}
    for seed in seeds:
        work = workload(seed, trajectories, steps)
        for policy_name, policy in POLICIES.items():
            runs[policy_name].append(_run(work, cores, policy, estimates))
    means = {
        policy: {
            key: statistics.fmean(run[key] for run in results)
            for key in (*METRICS, "simulate_seconds")
        }
        for policy, results in runs.items()
    }
    ratios: dict[str, dict[str, float]] = {}
    worst: dict[str, float] = {}
    for base in BASELINES:
        per_seed = {
            metric: [
                b[metric] / t[metric] for b, t in zip(runs[base], runs["tangram"], strict=True)
            ]
            for metric in METRICS
        }
        ratios[base] = {metric: _geomean(values) for metric, values in per_seed.items()}
        worst[base] = min(per_seed["avg_act"])
    return {
        "name": name,
        "cores": cores,
        "estimates": estimates,
        "means": means,
        "ratios": ratios,
        "worst_seed_avg_act_ratio": worst,
    }


def _table(result: Mapping[str, Any]) -> str:
    header = (
        f"{'policy':<14}{'avg ACT':>9}{'p95 ACT':>9}{'step s':>9}{'unit-s':>10}"
        f"  {'ratios baseline/tangram: avg':>28}{'p95':>6}{'step':>6}{'unit':>6}"
    )
    lines = [
        f"{result['name']}: {result['cores']} cores, estimates {result['estimates']}",
        header,
        "-" * len(header),
    ]
    for policy, m in result["means"].items():
        line = (
            f"{policy:<14}{m['avg_act']:>9.2f}{m['p95_act']:>9.2f}"
            f"{m['step_seconds']:>9.1f}{m['unit_seconds']:>10.0f}"
        )
        if policy in result["ratios"]:
            r = result["ratios"][policy]
            line += (
                f"  {r['avg_act']:>28.2f}{r['p95_act']:>6.2f}"
                f"{r['step_seconds']:>6.2f}{r['unit_seconds']:>6.2f}"
            )
        lines.append(line)
    return "\n".join(lines)


def _trace(config: GenerateConfig) -> tangram.Trace:
    return tangram.read_trace(list(generate_lines(config)))


def _ratios(
    trace: tangram.Trace, overrides: Mapping[str, float] | None, policies: Sequence[str]
) -> dict[str, dict[str, float]]:
    """avg and p95 ACT of each policy on ``trace``."""
    out = {}
    for name in policies:
        result = run_policy(name, trace, overrides)
        out[name] = {"avg_act": result.avg_act, "p95_act": result.act_quantile(0.95)}
    return out


def overload(seeds: Sequence[int], batch: int, big: int) -> dict[str, Any]:
    """Size-aware admission against its references, per seed (see the module docstring)."""
    variants = {
        "heavy_tail_burst": lambda seed: (
            GenerateConfig(workload="coding", batch=batch, seed=seed, contended=True),
            None,
        ),
        "heavy_tail_burst_big": lambda seed: (
            GenerateConfig(workload="coding", batch=big, seed=seed, contended=True),
            None,
        ),
        "lognormal_contended": lambda seed: (
            GenerateConfig(workload="coding", batch=batch, seed=seed),
            {"cpu": round(0.3 * batch)},
        ),
    }
    figures: dict[str, Any] = {}
    for name, make in variants.items():
        per_seed = []
        for seed in seeds:
            config, overrides = make(seed)
            acts = _ratios(_trace(config), overrides, ("tangram", "srpt", "tangram-fcfs"))
            per_seed.append(
                {
                    "seed": seed,
                    "acts": {p: {k: round(v, 4) for k, v in m.items()} for p, m in acts.items()},
                    "avg_vs_srpt": acts["tangram"]["avg_act"] / acts["srpt"]["avg_act"],
                    "p95_vs_fcfs": acts["tangram"]["p95_act"] / acts["tangram-fcfs"]["p95_act"],
                    "avg_vs_fcfs": acts["tangram"]["avg_act"] / acts["tangram-fcfs"]["avg_act"],
                }
            )
        figures[name] = {
            "batch": config.batch,
            "per_seed": per_seed,
            **{
                f"{key}_worst": round(max(s[key] for s in per_seed), 4)
                for key in ("avg_vs_srpt", "p95_vs_fcfs", "avg_vs_fcfs")
            },
        }
    return figures


def mopd(seeds: Sequence[int], variants: Mapping[str, tuple[int, float]]) -> dict[str, Any]:
    """GPU services under contention: tangram against ``pooled`` (and ``static``), per seed.

    ``variants``: name -> (batch, Zipf exponent) of the contended MOPD trace.
    """
    figures: dict[str, Any] = {}
    for name, (batch, zipf) in variants.items():
        per_seed = []
        for seed in seeds:
            config = GenerateConfig(
                workload="mopd", batch=batch, seed=seed, contended=True, zipf=zipf
            )
            started = time.perf_counter()
            acts = _ratios(_trace(config), None, ("tangram", "pooled", "static"))
            per_seed.append(
                {
                    "seed": seed,
                    "acts": {p: {k: round(v, 4) for k, v in m.items()} for p, m in acts.items()},
                    "avg_vs_pooled": acts["tangram"]["avg_act"] / acts["pooled"]["avg_act"],
                    "p95_vs_pooled": acts["tangram"]["p95_act"] / acts["pooled"]["p95_act"],
                    "simulate_seconds": round(time.perf_counter() - started, 2),
                }
            )
        figures[name] = {
            "batch": batch,
            "zipf": zipf,
            "per_seed": per_seed,
            **{
                f"{key}_worst": round(max(s[key] for s in per_seed), 4)
                for key in ("avg_vs_pooled", "p95_vs_pooled")
            },
        }
    return figures


# The fixed DoPs ``tangram simulate`` is compared at (docs/simulate.md): one core to the
# generated traces' largest elastic maximum, 16. A K above an action's maximum runs it at
# its maximum, so no other K decides differently on these traces.
DEEPSEARCH_DOPS = (1, 2, 4, 8, 16)


def deepsearch(seeds: Sequence[int], batch: int) -> dict[str, Any]:
    """API-bound deepsearch: tangram against ``static`` and every fixed DoP, per seed."""
    fixed = [f"fixed-dop-{k}" for k in DEEPSEARCH_DOPS]
    per_seed = []
    for seed in seeds:
        trace = _trace(
            GenerateConfig(workload="deepsearch", batch=batch, seed=seed, contended=True)
        )
        started = time.perf_counter()
        acts = _ratios(trace, None, ("tangram", "static", *fixed))
        best = min(fixed, key=lambda name: acts[name]["avg_act"])
        per_seed.append(
            {
                "seed": seed,
                "capacity": dict(trace.capacity),
                "acts": {p: {k: round(v, 4) for k, v in m.items()} for p, m in acts.items()},
                "best_fixed_dop": best,
                "avg_vs_static": acts["tangram"]["avg_act"] / acts["static"]["avg_act"],
                "avg_vs_best_fixed_dop": acts["tangram"]["avg_act"] / acts[best]["avg_act"],
                "simulate_seconds": round(time.perf_counter() - started, 2),
            }
        )
    return {
        "batch": batch,
        "fixed_dops": list(DEEPSEARCH_DOPS),
        "per_seed": per_seed,
        **{
            f"{key}_worst": max(s[key] for s in per_seed)
            for key in ("avg_vs_static", "avg_vs_best_fixed_dop")
        },
    }


def coding(seeds: Sequence[int], batch: int) -> dict[str, Any]:
    """Tangram on coding traces at 1 and 1.125 cores per trajectory."""
    per_seed = []
    for seed in seeds:
        trace = _trace(GenerateConfig(workload="coding", batch=batch, seed=seed))
        row: dict[str, Any] = {"seed": seed}
        for label, cores in (("1", batch), ("1.125", round(1.125 * batch))):
            acts = _ratios(trace, {"cpu": cores}, ("tangram", "tangram-fcfs", "bound"))
            row[f"vs_bound_{label}"] = acts["tangram"]["avg_act"] / acts["bound"]["avg_act"]
            row[f"vs_fcfs_{label}"] = acts["tangram"]["avg_act"] / acts["tangram-fcfs"]["avg_act"]
        per_seed.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    worst = {
        key: max(row[key] for row in per_seed)
        for key in ("vs_bound_1", "vs_bound_1.125", "vs_fcfs_1", "vs_fcfs_1.125")
    }
    return {"batch": batch, "per_seed": per_seed, "worst": worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds (under a minute)")
    parser.add_argument("--seeds", type=int, help="number of seeded workloads per scenario")
    parser.add_argument("--trajectories", type=int, default=64, help="trajectories per step")
    parser.add_argument("--steps", type=int, default=6, help="actions per trajectory")
    args = parser.parse_args(argv)
    seeds = range(args.seeds or (3 if args.quick else 10))
    n = args.trajectories
    scenarios: list[tuple[str, int, Estimates]] = [
        ("roomy", n, "exact"),
        ("congested", max(1, n // 4), "exact"),
        ("roomy-learned", n, "learned"),
        ("congested-learned", max(1, n // 4), "learned"),
    ]
    print(
        f"policy_quality: {n} trajectories x {args.steps} actions, {len(seeds)} seeds per "
        f"scenario; ratios are geometric means over seeds of baseline / tangram",
        flush=True,
    )
    results = []
    for name, cores, estimates in scenarios:
        results.append(scenario(name, cores, estimates, seeds, n, args.steps))
        print()
        print(_table(results[-1]), flush=True)
    targets: dict[str, dict[str, Any]] = {}
    for result in results:
        ratios = result["ratios"]
        weakest = min(BASELINES, key=lambda base: ratios[base]["avg_act"])
        value = ratios[weakest]["avg_act"]
        targets[f"avg_act_ratio_min_{result['name'].replace('-', '_')}"] = {
            "value": round(value, 3),
            "goal": "> 1",
            "met": value > 1.0,
            "against": weakest,
        }
    overload_seeds = range(3)
    burst = 200 if args.quick else 400
    heavy = overload(overload_seeds, burst, 400 if args.quick else 1000)
    # The coding goal is stated at 256 trajectories (smaller batches sit nearer the bound's
    # 1.3x); the quick run takes one seed of it.
    code = coding(range(1) if args.quick else overload_seeds, 256)
    print()
    for name, figure in heavy.items():
        print(
            f"{name} ({figure['batch']} trajectories, 0.3 cores each), worst of "
            f"{len(overload_seeds)} seeds: avg ACT {figure['avg_vs_srpt_worst']:.3f}x srpt's, "
            f"p95 {figure['p95_vs_fcfs_worst']:.3f}x and avg "
            f"{figure['avg_vs_fcfs_worst']:.3f}x tangram-fcfs's"
        )
    print(f"coding ({code['batch']} trajectories), worst seed: {code['worst']}")
    # The target is stated on the default contended MOPD trace; the full run adds a size
    # and Zipf exponents the placement rules were not tuned on, reported, not targeted.
    variants = {"mopd_contended": (2048, 1.1)}
    if not args.quick:
        variants |= {
            "mopd_contended_4096": (4096, 1.1),
            "mopd_contended_1024": (1024, 1.1),
            "mopd_contended_zipf_0.8": (2048, 0.8),
            "mopd_contended_zipf_1.5": (2048, 1.5),
        }
    gpu = mopd(overload_seeds, variants)
    for name, figure in gpu.items():
        print(
            f"{name} ({figure['batch']} trajectories, Zipf {figure['zipf']}, 10 GPUs), worst "
            f"of {len(overload_seeds)} seeds: avg ACT {figure['avg_vs_pooled_worst']:.3f}x "
            f"and p95 {figure['p95_vs_pooled_worst']:.3f}x pooled's"
        )
    # The deepsearch target is stated on 3 seeds; the quick run takes one smaller trace.
    search = deepsearch(range(1) if args.quick else overload_seeds, 128 if args.quick else 256)
    capacity = search["per_seed"][0]["capacity"]
    print(
        f"deepsearch_contended ({search['batch']} trajectories, search API "
        f"{capacity['search_api']:g}/s and {capacity['search_api_concurrency']:g} "
        f"connections, {capacity['gpu']:g} GPUs), worst of {len(search['per_seed'])} seeds: "
        f"avg ACT {search['avg_vs_static_worst']:.4f}x static's, "
        f"{search['avg_vs_best_fixed_dop_worst']:.4f}x the best fixed DoP's"
    )
    for row in search["per_seed"]:
        print(
            f"  seed {row['seed']}: avg ACT "
            + ", ".join(f"{p} {m['avg_act']:.4f}" for p, m in row["acts"].items())
        )
    overload_goals = [
        ("heavy_tail_avg_act_vs_srpt", heavy["heavy_tail_burst"]["avg_vs_srpt_worst"], 1.05),
        ("heavy_tail_p95_act_vs_fcfs", heavy["heavy_tail_burst"]["p95_vs_fcfs_worst"], 1.10),
        ("coding_1125_avg_act_vs_bound", code["worst"]["vs_bound_1.125"], 1.3),
        ("coding_1_avg_act_vs_fcfs", code["worst"]["vs_fcfs_1"], 1.01),
        ("coding_1125_avg_act_vs_fcfs", code["worst"]["vs_fcfs_1.125"], 1.01),
        ("mopd_avg_act_vs_pooled", gpu["mopd_contended"]["avg_vs_pooled_worst"], 1.3),
        ("mopd_p95_act_vs_pooled", gpu["mopd_contended"]["p95_vs_pooled_worst"], 1.3),
    ]
    for key, value, goal in overload_goals:
        targets[key] = {"value": round(value, 4), "goal": f"<= {goal}", "met": value <= goal}
    # Strictly below: the issue asks for tangram *below* static and every fixed DoP.
    for key, value in (
        ("deepsearch_avg_act_vs_static", search["avg_vs_static_worst"]),
        ("deepsearch_avg_act_vs_best_fixed_dop", search["avg_vs_best_fixed_dop_worst"]),
    ):
        targets[key] = {"value": round(value, 4), "goal": "< 1", "met": value < 1.0}
    print()
    for key, target in targets.items():
        verdict = "met" if target["met"] else "MISSED"
        against = f" vs {target['against']}" if "against" in target else ""
        print(f"{key}: {target['value']:.3f}{against} (goal {target['goal']}): {verdict}")
    figures = {
        "trajectories": n,
        "steps": args.steps,
        "seeds": len(seeds),
        "quick": args.quick,
        "scenarios": {
            r["name"]: {
                "cores": r["cores"],
                "estimates": r["estimates"],
                "means": {
                    p: {k: round(v, 3) for k, v in m.items() if k != "simulate_seconds"}
                    for p, m in r["means"].items()
                },
                "simulate_seconds": {
                    p: round(m["simulate_seconds"], 4) for p, m in r["means"].items()
                },
                "ratios": {
                    b: {k: round(v, 3) for k, v in m.items()} for b, m in r["ratios"].items()
                },
                "worst_seed_avg_act_ratio": {
                    b: round(v, 3) for b, v in r["worst_seed_avg_act_ratio"].items()
                },
            }
            for r in results
        },
        "overload": heavy,
        "coding": code,
        "gpu_contention": gpu,
        "deepsearch": {
            **search,
            **{
                key: round(search[key], 4)
                for key in ("avg_vs_static_worst", "avg_vs_best_fixed_dop_worst")
            },
            "per_seed": [
                {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                for row in search["per_seed"]
            ],
        },
    }
    print(json.dumps({"bench": "policy_quality", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
