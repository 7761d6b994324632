"""The interfaces tangram is extended through, apart from the API its users call.

Write a scheduling policy (:class:`Policy`, reading a :class:`State`, returning a
:class:`Plan`), a sandbox backend (:class:`SandboxBackend` making :class:`SandboxHandle`
objects), or code that works on any scheduler (:class:`Scheduler`, which the local
``tangram.Runtime`` and a shared scheduler's ``tangram.ray.RemoteRuntime`` both satisfy,
and :class:`LeaseLike`, what either grants). As ``anyio.abc`` beside ``anyio``: the names
here are for those who build on tangram; ``tangram`` itself keeps the names every rollout
uses.

The registries say which implementations a name chooses: :data:`POLICIES` for a config
file's ``[policy] name`` and the simulator's arms, :data:`BACKENDS` for ``[sandbox]
backend``, the CLI and the bench. Adding one is one entry there.
"""

from ._core._exports import publish as _publish
from ._core._policies import POLICIES as POLICIES
from ._core._policies import policy_class as policy_class
from ._core._policy import Entry as Entry
from ._core._policy import Plan as Plan
from ._core._policy import Policy as Policy
from ._core._policy import State as State
from ._runtime._scheduler import LeaseLike as LeaseLike
from ._runtime._scheduler import Scheduler as Scheduler
from ._sandbox._backend import BACKENDS as BACKENDS
from ._sandbox._backend import ExecRequest as ExecRequest
from ._sandbox._backend import ExecResult as ExecResult
from ._sandbox._backend import Host as Host
from ._sandbox._backend import SandboxBackend as SandboxBackend
from ._sandbox._backend import SandboxHandle as SandboxHandle
from ._sandbox._backend import backend_class as backend_class

__all__ = [
    "BACKENDS",
    "POLICIES",
    "Entry",
    "ExecRequest",
    "ExecResult",
    "Host",
    "LeaseLike",
    "Plan",
    "Policy",
    "SandboxBackend",
    "SandboxHandle",
    "Scheduler",
    "State",
    "backend_class",
    "policy_class",
]

_publish("tangram.abc", globals())
