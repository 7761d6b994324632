"""Policies by name: the one list a config file's ``[policy] name`` and the simulator read.

A policy is any object with a pure ``plan(state) -> Plan`` (:class:`~._policy.Policy`);
these are the ones a name can choose. Adding one here makes it a config value and a
simulator arm at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ..errors import SettingTypeError, UnknownPolicyError
from ._fcfs import FcfsPolicy
from ._policy import ElasticPolicy, Policy

__all__ = ["DEFAULT_POLICY", "POLICIES", "policy_class"]

POLICIES: Mapping[str, type[Policy]] = MappingProxyType(
    {"elastic": ElasticPolicy, "fcfs": FcfsPolicy}
)
"""Policy name -> class; each is built with the keyword arguments of its table."""

DEFAULT_POLICY = "elastic"
"""What a runtime, a config file and the simulator use when nothing names one."""


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name``.

    :raises SettingTypeError: ``name`` is not a string.
    :raises UnknownPolicyError: no policy has that name (also a ``LookupError``).
    """
    if not isinstance(name, str):
        raise SettingTypeError(f"a policy name must be a string (got {name!r})")
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(f"no policy named {name!r} (known: {sorted(POLICIES)})") from None
