"""Tangram: action-level scheduling of external resources for agentic RL rollouts.

Wrap each external action of a rollout in ``async with tangram.acquire(...)`` inside
``async with tangram.Runtime(capacity=...)``; the runtime lends each action what it needs
for as long as it runs, grows and shrinks elastic actions, and keeps every trajectory
moving.
"""

from . import abc as abc
from . import errors as errors
from ._core._action import Action as Action
from ._core._demand import Demand as Demand
from ._core._demand import Elastic as Elastic
from ._core._efficiency import Amdahl as Amdahl
from ._core._efficiency import Efficiency as Efficiency
from ._core._efficiency import Linear as Linear
from ._core._efficiency import Power as Power
from ._core._efficiency import SpeedupTable as SpeedupTable
from ._core._estimator import Estimate as Estimate
from ._core._estimator import Estimator as Estimator
from ._core._fcfs import FcfsPolicy as FcfsPolicy
from ._core._policy import ElasticPolicy as ElasticPolicy
from ._core._resources import Capacity as Capacity
from ._core._resources import Rate as Rate
from ._core._stats import KindStats as KindStats
from ._core._stats import Outcome as Outcome
from ._core._stats import ResourceStats as ResourceStats
from ._core._stats import Stats as Stats
from ._core._stats import Summary as Summary
from ._runtime._instrument import Instrument as Instrument
from ._runtime._lease import Lease as Lease
from ._runtime._run import AcquireContext as AcquireContext
from ._runtime._run import Runtime as Runtime
from ._runtime._run import acquire as acquire
from ._runtime._run import current_runtime as current_runtime
from ._sandbox._backend import RunResult as RunResult
from ._sandbox._docker._backend import DockerBackend as DockerBackend
from ._sandbox._docker._backend import DockerConfig as DockerConfig
from ._sandbox._local._backend import LocalBackend as LocalBackend
from ._sandbox._pool import Sandbox as Sandbox
from ._sandbox._pool import SandboxPool as SandboxPool
from ._sim._record import TraceRecorder as TraceRecorder
from ._sim._record import record_trace as record_trace
from ._sim._residency import ServiceSpec as ServiceSpec
from ._sim._simulate import ActionRecord as ActionRecord
from ._sim._simulate import SimulationResult as SimulationResult
from ._sim._simulate import Step as Step
from ._sim._simulate import simulate as simulate
from ._sim._trace import Trace as Trace
from ._sim._trace import TraceAction as TraceAction
from ._sim._trace import read_trace as read_trace

__version__ = "0.1.0"

from ._core._exports import publish as _publish

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
    "FcfsPolicy",
    "ServiceSpec",
    "Instrument",
    "KindStats",
    "Lease",
    "Linear",
    "LocalBackend",
    "Outcome",
    "Power",
    "Rate",
    "ResourceStats",
    "RunResult",
    "Runtime",
    "Sandbox",
    "SandboxPool",
    "SimulationResult",
    "Stats",
    "Step",
    "Summary",
    "SpeedupTable",
    "Trace",
    "TraceAction",
    "TraceRecorder",
    "acquire",
    "current_runtime",
    "abc",
    "errors",
    "read_trace",
    "record_trace",
    "simulate",
]

_publish("tangram", globals())

# Extension interfaces moved to tangram.abc; the old names work, with a warning, for
# one more release.
_MOVED = frozenset(
    {
        "Entry",
        "ExecRequest",
        "ExecResult",
        "Host",
        "Plan",
        "Policy",
        "SandboxBackend",
        "SandboxHandle",
        "State",
    }
)


def __getattr__(name: str) -> object:
    if name in _MOVED:
        import warnings

        warnings.warn(
            f"tangram.{name} is now tangram.abc.{name}; "
            "the old name will be removed in a future release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(abc, name)
    raise AttributeError(f"module 'tangram' has no attribute {name!r}")
