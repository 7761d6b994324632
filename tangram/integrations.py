"""The kit framework adapters are built from: ``tangram.integrations``.

An RL framework builds its tools, reward functions and agent loops itself, in worker
processes tangram never sees start, and calls them from whatever event loop runs there.
It hands them no runtime, only settings it reads from its own files. So an adapter
(``tangram_verl``, ``tangram_openrlhf``, or one of your own for another framework) is the
same few parts each time, all of them here:

- **A session per worker** (:func:`session`, :func:`check`, :func:`config_for`,
  :func:`aclose`): the framework passes a config path at most, so each call asks
  :func:`session` for this process and loop's scheduler and pools, started on first use
  from the file (``$TANGRAM_CONFIG`` by default; see :mod:`tangram.config`). Call
  :func:`check` where the framework builds the adapter's objects, so a bad set-up fails
  the worker at start, not every call after it. :func:`portal_call` runs a coroutine
  from a synchronous hook the framework calls in a worker thread.
- **Settings, demands and results in the framework's shapes** (:func:`cpu_demand`,
  :func:`demand_of`, :func:`flag_of`, :func:`seconds_of`, :func:`count_of`,
  :func:`text_of`, :func:`extract_code`, :func:`format_result`, :func:`result_metrics`):
  a YAML's ``cpu: {min: 1, max: 4}`` as a demand and its ``partial: false`` or
  ``timeout: 30`` as what they say, checked where the adapter is built and naming where
  they came from (a quoted ``"false"`` is a ``ConfigError``, never true); a sandbox's
  result as the text the model reads back and as the numbers the framework logs.
- **The rule for tangram's own failures** (:func:`is_infrastructure`, :func:`record`): a
  command that fails is the model's result and goes back to the model; tangram failing
  under it (the scheduler gone, a sandbox that died, a bug of its own) is not, and must reach the
  framework as an exception *outside* the handler that turns a tool's errors into
  observations, counted and logged at ERROR by :func:`record`.
- **Sandboxes the framework drops** (:func:`release_later`): a sandbox bound to an object
  the framework discards without a call (a trajectory's state) goes back when that object
  is collected, on the loop that entered it.
- **Group rewards** (:class:`Gate`, :data:`DEFAULT_GROUP_WAIT`): a prompt's samples reach
  the scheduler together, so GRPO's groups finish one after another.
- **The code reward** (:func:`grade`, :func:`parse_tests`, :class:`Verdict`): an answer's
  code graded against a dataset's tests by tangram's harness, in a sandbox, with a
  verdict the answer cannot forge.
- **Per-step figures** (:func:`step_logs`, :func:`is_level`): the scheduler's change since
  the last step, for the framework's own logger (see :mod:`tangram.metrics`).

``docs/adapters.md`` builds an adapter for a new framework from these parts. ``import
tangram`` does not import this module.
"""

from __future__ import annotations

from ._core._exports import publish as _publish
from ._frameworks._convert import count_of as count_of
from ._frameworks._convert import cpu_demand as cpu_demand
from ._frameworks._convert import demand_of as demand_of
from ._frameworks._convert import extract_code as extract_code
from ._frameworks._convert import flag_of as flag_of
from ._frameworks._convert import format_result as format_result
from ._frameworks._convert import result_metrics as result_metrics
from ._frameworks._convert import seconds_of as seconds_of
from ._frameworks._convert import text_of as text_of
from ._frameworks._failures import is_infrastructure as is_infrastructure
from ._frameworks._failures import record as record
from ._frameworks._metrics import is_level as is_level
from ._frameworks._metrics import step_logs as step_logs
from ._frameworks._session import Resources as Resources
from ._frameworks._session import aclose as aclose
from ._frameworks._session import check as check
from ._frameworks._session import config_for as config_for
from ._frameworks._session import load_object as load_object
from ._frameworks._session import portal_call as portal_call
from ._frameworks._session import release_later as release_later
from ._frameworks._session import session as session
from ._reward._grade import Verdict as Verdict
from ._reward._grade import grade as grade
from ._reward._grade import parse_tests as parse_tests
from ._runtime._group import DEFAULT_GROUP_WAIT as DEFAULT_GROUP_WAIT
from ._runtime._group import Gate as Gate

__all__ = [
    "DEFAULT_GROUP_WAIT",
    "Gate",
    "Resources",
    "Verdict",
    "aclose",
    "check",
    "config_for",
    "count_of",
    "cpu_demand",
    "demand_of",
    "extract_code",
    "flag_of",
    "format_result",
    "grade",
    "is_infrastructure",
    "is_level",
    "load_object",
    "parse_tests",
    "portal_call",
    "record",
    "release_later",
    "result_metrics",
    "seconds_of",
    "session",
    "step_logs",
    "text_of",
]

_publish("tangram.integrations", globals())
