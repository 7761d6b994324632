"""Tangram: action-level scheduling of external resources for agentic RL rollouts.

Wrap each external action of a rollout in ``async with tangram.acquire(...)`` inside
``async with tangram.Runtime(capacity=...)``; the runtime lends each action what it needs
for as long as it runs, grows and shrinks elastic actions, and keeps every trajectory
moving.
"""

from __future__ import annotations

import contextlib as _contextlib

from . import errors as errors
from ._action import Action as Action
from ._demand import Demand as Demand
from ._demand import Elastic as Elastic
from ._efficiency import Amdahl as Amdahl
from ._efficiency import Efficiency as Efficiency
from ._efficiency import Linear as Linear
from ._efficiency import Power as Power
from ._efficiency import Table as Table
from ._estimator import Estimate as Estimate
from ._estimator import Estimator as Estimator
from ._lease import Lease as Lease
from ._policy import ElasticPolicy as ElasticPolicy
from ._policy import FcfsPolicy as FcfsPolicy
from ._policy import Plan as Plan
from ._policy import Policy as Policy
from ._resources import Capacity as Capacity
from ._resources import Rate as Rate
from ._runtime import AcquireContext as AcquireContext
from ._runtime import Runtime as Runtime
from ._runtime import acquire as acquire
from ._runtime import current_runtime as current_runtime
from ._simulate import ActionRecord as ActionRecord
from ._simulate import SimulationResult as SimulationResult
from ._simulate import Step as Step
from ._simulate import simulate as simulate
from ._stats import KindStats as KindStats
from ._stats import Outcome as Outcome
from ._stats import ResourceStats as ResourceStats
from ._stats import Stats as Stats
from ._stats import Summary as Summary

__version__ = "0.1.0"

__all__ = [
    "AcquireContext",
    "Action",
    "ActionRecord",
    "Amdahl",
    "Capacity",
    "Demand",
    "Efficiency",
    "Elastic",
    "ElasticPolicy",
    "Estimate",
    "Estimator",
    "FcfsPolicy",
    "KindStats",
    "Lease",
    "Linear",
    "Outcome",
    "Plan",
    "Policy",
    "Power",
    "Rate",
    "ResourceStats",
    "Runtime",
    "SimulationResult",
    "Stats",
    "Step",
    "Summary",
    "Table",
    "acquire",
    "current_runtime",
    "simulate",
    "errors",
]

# Tracebacks and reprs say ``tangram.Runtime``, not the private module it lives in.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("tangram._"):
        with _contextlib.suppress(AttributeError, TypeError):
            _obj.__module__ = "tangram"
del _name, _obj
