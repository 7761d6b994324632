"""The public surface: ``tangram.__all__`` lists exactly what is public, named ``tangram.X``.

Like httpx's ``tests/test_exported_members.py``: code lives in private modules and the
package re-exports it, so a name added to a private module and forgotten in ``__all__``
(or exported without its ``__module__`` fixed) shows up here.
"""

from __future__ import annotations
import __future__

import importlib.metadata
import inspect
import re
import types

import pytest

import tangram
import tangram.errors


def public_names(module: types.ModuleType) -> set[str]:
    """Public attributes of ``module``, not counting other modules and __future__ flags.

    Submodules are attributes of their package only once something imports them (an
    optional extra such as ``tangram.quota``), so they are left to ``__all__`` itself.
    """
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, (types.ModuleType, __future__._Feature))
    }


def test_all_lists_every_public_name_once() -> None:
    assert len(tangram.__all__) == len(set(tangram.__all__))
    modules = {name for name in tangram.__all__ if inspect.ismodule(getattr(tangram, name))}
    assert modules == {"abc", "errors"}
    assert set(tangram.__all__) - modules == public_names(tangram)


def test_errors_all_lists_every_error_once() -> None:
    names = tangram.errors.__all__
    assert len(names) == len(set(names))
    assert set(names) == public_names(tangram.errors)


@pytest.mark.parametrize("name", sorted(set(tangram.__all__) - {"abc", "errors"}))
def test_exported_objects_say_they_are_from_tangram(name: str) -> None:
    obj = getattr(tangram, name)
    assert obj.__module__ == "tangram"
    assert obj.__name__ == name
    assert obj.__qualname__ == name


@pytest.mark.parametrize("name", tangram.errors.__all__)
def test_errors_say_they_are_from_tangram_errors(name: str) -> None:
    error = getattr(tangram.errors, name)
    assert error.__module__ == "tangram.errors"
    assert repr(error) == f"<class 'tangram.errors.{name}'>"


def test_errors_module_is_the_public_one() -> None:
    assert tangram.errors.__name__ == "tangram.errors"


def test_version_matches_the_distribution() -> None:
    assert tangram.__version__ == importlib.metadata.version("tangram")


def test_facades_that_reexport_errors_leave_them_in_tangram_errors() -> None:
    # tangram.gpu and tangram.quota re-export their errors for ``except gpu.GpuError``;
    # publishing their own names must not relabel what tangram.errors owns.
    import tangram.gpu
    import tangram.quota

    reexported = {
        name
        for module in (tangram.gpu, tangram.quota)
        for name in module.__all__
        if name in tangram.errors.__all__
    }
    assert reexported
    for name in reexported:
        assert getattr(tangram.errors, name).__module__ == "tangram.errors"
    assert tangram.gpu.GpuPool.__module__ == "tangram.gpu"
    assert tangram.quota.Quota.__module__ == "tangram.quota"


def test_the_metrics_facade_exports_its_two_names_as_its_own() -> None:
    import tangram.metrics

    assert public_names(tangram.metrics) == set(tangram.metrics.__all__)
    assert set(tangram.metrics.__all__) == {"Collector", "StepMetrics"}
    for name in tangram.metrics.__all__:
        assert getattr(tangram.metrics, name).__module__ == "tangram.metrics"


def test_the_config_facade_counts_infrastructure_failures_under_its_own_name() -> None:
    import tangram.config
    from tangram._frameworks import _failures

    _failures.reset()
    _failures.record("run_code", RuntimeError("the scheduler is gone"))
    assert tangram.config.infrastructure_failures() == {"run_code": 1}
    assert tangram.config.infrastructure_failures.__module__ == "tangram.config"
    _failures.reset()


def test_the_extension_interfaces_live_in_tangram_abc() -> None:
    import tangram.abc

    assert set(tangram.abc.__all__) == public_names(tangram.abc)
    for name in tangram.abc.__all__:
        obj = getattr(tangram.abc, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == "tangram.abc", name
    # Extension interfaces are not beside the API every rollout uses.
    assert not set(tangram.abc.__all__) & set(tangram.__all__)


MOVED = ["Entry", "ExecRequest", "ExecResult", "Host", "Plan", "Policy", "SandboxBackend"]
MOVED += ["SandboxHandle", "State"]


@pytest.mark.parametrize("name", MOVED)
def test_a_moved_name_still_works_from_tangram_with_a_warning(name: str) -> None:
    import tangram.abc

    with pytest.warns(DeprecationWarning, match=f"tangram.abc.{name}"):
        old = getattr(tangram, name)
    assert old is getattr(tangram.abc, name)
    with pytest.raises(AttributeError, match="no attribute 'Nonexistent'"):
        tangram.Nonexistent  # noqa: B018


def test_both_schedulers_satisfy_the_scheduler_protocol() -> None:
    import tangram.abc
    import tangram.ray

    local = tangram.Runtime({"cpu": 2})
    assert isinstance(local, tangram.abc.Scheduler)
    # A proxy not yet attached to any actor: its checks need none.
    remote = tangram.ray.RemoteRuntime(None, heartbeat=1.0, capacity=local.capacity)
    assert isinstance(remote, tangram.abc.Scheduler)
    assert not isinstance(object(), tangram.abc.Scheduler)


def test_a_shared_schedulers_proxy_refuses_a_bad_demand_at_the_call_as_a_runtime_does() -> None:
    """Without a runtime of its own to check with: the same errors from the same rule."""
    import tangram.ray

    local = tangram.Runtime({"cpu": 2})
    remote = tangram.ray.RemoteRuntime(None, heartbeat=1.0, capacity=local.capacity)
    for bad in ({"cpu": 5}, {"gpu": 1}, {"cpu": -1}, {"cpu": True}):
        with pytest.raises(tangram.errors.InvalidDemandError) as here:
            local.acquire(bad)
        with pytest.raises(type(here.value), match=re.escape(str(here.value))):
            remote.acquire(bad)
    with pytest.raises(tangram.errors.InvalidDemandError, match="wait_timeout"):
        remote.acquire(cpu=1, wait_timeout=-1)
    assert remote.acquire(cpu=1).action.demand == local.acquire(cpu=1).action.demand
