"""Tangram: action-level scheduling of external resources for agentic RL rollouts.

Wrap each external action of a rollout in ``async with tangram.acquire(...)`` inside
``async with tangram.Runtime(capacity=...)``; the runtime lends each action what it needs
for as long as it runs, grows and shrinks elastic actions, and keeps every trajectory
moving.
"""

import contextlib as _contextlib

from . import errors as errors
from ._action import Action as Action
from ._demand import Demand as Demand
from ._demand import Elastic as Elastic
from ._docker import DockerBackend as DockerBackend
from ._docker import DockerConfig as DockerConfig
from ._efficiency import Amdahl as Amdahl
from ._efficiency import Efficiency as Efficiency
from ._efficiency import Linear as Linear
from ._efficiency import Power as Power
from ._efficiency import Table as Table
from ._estimator import Estimate as Estimate
from ._estimator import Estimator as Estimator
from ._lease import Lease as Lease
from ._local import LocalBackend as LocalBackend
from ._policy import ElasticPolicy as ElasticPolicy
from ._policy import FcfsPolicy as FcfsPolicy
from ._policy import Plan as Plan
from ._policy import Policy as Policy
from ._record import TraceRecorder as TraceRecorder
from ._record import record_trace as record_trace
from ._resources import Capacity as Capacity
from ._resources import Rate as Rate
from ._runtime import AcquireContext as AcquireContext
from ._runtime import Runtime as Runtime
from ._runtime import acquire as acquire
from ._runtime import current_runtime as current_runtime
from ._sandbox import ExecRequest as ExecRequest
from ._sandbox import ExecResult as ExecResult
from ._sandbox import Host as Host
from ._sandbox import RunResult as RunResult
from ._sandbox import Sandbox as Sandbox
from ._sandbox import SandboxBackend as SandboxBackend
from ._sandbox import SandboxHandle as SandboxHandle
from ._sandbox import SandboxPool as SandboxPool
from ._sim_gpu import GpuService as GpuService
from ._simulate import ActionRecord as ActionRecord
from ._simulate import SimulationResult as SimulationResult
from ._simulate import Step as Step
from ._simulate import simulate as simulate
from ._stats import KindStats as KindStats
from ._stats import Outcome as Outcome
from ._stats import ResourceStats as ResourceStats
from ._stats import Stats as Stats
from ._stats import Summary as Summary
from ._trace import Trace as Trace
from ._trace import TraceAction as TraceAction
from ._trace import read_trace as read_trace

__version__ = "0.1.0"

__all__ = [
    "AcquireContext",
    "Action",
    "ActionRecord",
    "Amdahl",
    "Capacity",
    "Demand",
    "DockerBackend",
    "DockerConfig",
    "Efficiency",
    "Elastic",
    "ElasticPolicy",
    "Estimate",
    "Estimator",
    "ExecRequest",
    "ExecResult",
    "FcfsPolicy",
    "GpuService",
    "Host",
    "KindStats",
    "Lease",
    "Linear",
    "LocalBackend",
    "Outcome",
    "Plan",
    "Policy",
    "Power",
    "Rate",
    "ResourceStats",
    "RunResult",
    "Runtime",
    "Sandbox",
    "SandboxBackend",
    "SandboxHandle",
    "SandboxPool",
    "SimulationResult",
    "Stats",
    "Step",
    "Summary",
    "Table",
    "Trace",
    "TraceAction",
    "TraceRecorder",
    "acquire",
    "current_runtime",
    "errors",
    "read_trace",
    "record_trace",
    "simulate",
]

# Tracebacks and reprs say ``tangram.Runtime``, not the private module it lives in.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("tangram._"):
        with _contextlib.suppress(AttributeError, TypeError):
            _obj.__module__ = "tangram"
del _name, _obj
