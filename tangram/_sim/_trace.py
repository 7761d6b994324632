"""Reading workload traces in the tangram-trace/1 format (see docs/traces.md).

A trace says what a rollout asks for, never how it was scheduled, so any policy can
replay it: :meth:`Trace.workload` turns it into the :class:`~tangram.Step` lists that
:func:`tangram.simulate` drives through the same ledger and policy as the live runtime.

Every malformed line is rejected with its line number and the reason
(:class:`~tangram.errors.TraceFormatError`), at read time, never halfway through a
simulation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .._core._demand import MOST_UNITS, Elastic
from .._core._efficiency import Efficiency, Linear, efficiency_from_dict
from .._core._resources import Rate
from ..errors import InvalidDemandError, SettingTypeError, TraceFormatError
from ._clock import LONGEST_SECONDS
from ._residency import ServiceSpec
from ._simulate import DEFAULT_GPU_MEM_GIB, Step

__all__ = ["FORMAT", "Trace", "TraceAction", "read_lines", "read_trace"]

FORMAT = "tangram-trace/1"
# Kinds held while an action runs; every other capacity kind is an API budget in requests
# (or tokens) per second, and ``<kind>_concurrency`` its slots.
_HELD = frozenset({"cpu", "gpu", "mem"})


def _is_held(kind: str) -> bool:
    return kind in _HELD or kind.endswith("_concurrency")


@attrs.frozen
class TraceAction:
    """One action line: what it needs, for how long, and when it is issued."""

    trajectory: str
    index: int
    gap: float
    kind: str
    resource: str
    min: float
    max: float
    seconds_at_1: float
    efficiency: Efficiency
    service: str | None = None
    mem_gib: float = 0.0
    line: int = 0


@attrs.frozen
class Trace:
    """A whole trace: its header and its actions grouped by trajectory, in index order."""

    name: str
    capacity: Mapping[str, float]
    services: Mapping[str, Mapping[str, Any]]
    gpu_mem_gib_per_device: float
    trajectories: Mapping[str, tuple[TraceAction, ...]]

    @property
    def actions(self) -> int:
        return sum(len(actions) for actions in self.trajectories.values())

    def is_rate(self, kind: str) -> bool:
        return not _is_held(kind)

    def runtime_capacity(self, overrides: Mapping[str, float] | None = None) -> dict[str, object]:
        """The capacity for :class:`tangram.Runtime` or :func:`tangram.simulate`.

        API kinds become :class:`tangram.Rate` budgets with one second's worth of burst;
        memory stays a count of GiB, like ``mem_gib`` on the action lines.
        """
        merged = {**self.capacity, **(overrides or {})}
        return {
            kind: Rate(value, burst=max(1.0, value)) if self.is_rate(kind) else value
            for kind, value in merged.items()
        }

    def gpu_services(self) -> dict[str, ServiceSpec]:
        """The header's services for ``simulate(services=...)``: residency and restores.

        A service without ``gpus`` takes one GPU; without ``gpu_mem_gib`` it fills one
        device's memory; without ``restore_seconds`` it restores for free.
        """
        return {
            name: ServiceSpec(
                name=name,
                gpus=int(spec.get("gpus", 1)),
                gpu_mem_gib=float(spec.get("gpu_mem_gib", self.gpu_mem_gib_per_device)),
                restore_seconds=float(spec.get("restore_seconds", 0.0)),
                max_batch=int(spec.get("max_batch", 1)),
            )
            for name, spec in sorted(self.services.items())
        }

    def workload(self) -> dict[str, list[Step]]:
        """Each trajectory's actions as :class:`tangram.Step`, ready for ``simulate``.

        Elastic actions are resizable, as cgroup-backed sandboxes are. GPU actions hold
        their GPUs for their ``seconds``, plus a restore when their service is not
        resident if ``simulate`` is given :meth:`gpu_services`.
        """
        steps: dict[str, list[Step]] = {}
        for name, actions in self.trajectories.items():
            steps[name] = [self._step(action) for action in actions]
        return steps

    def _step(self, action: TraceAction) -> Step:
        demand: dict[str, object] = {}
        if self.is_rate(action.resource):
            demand[action.resource] = action.max
            slots = f"{action.resource}_concurrency"
            if slots in self.capacity:
                demand[slots] = 1
        elif action.max > action.min:
            demand[action.resource] = Elastic(
                int(action.min), int(action.max), efficiency=action.efficiency, resizable=True
            )
        else:
            demand[action.resource] = action.max
        if action.mem_gib and "mem" in self.capacity:
            demand["mem"] = action.mem_gib
        return Step(
            demand=demand,
            seconds_at_1=action.seconds_at_1,
            efficiency=action.efficiency,
            gap=action.gap,
            kind=action.kind,
            service=action.service,
        )


def read_trace(source: str | Path | Iterable[str] | Iterable[bytes]) -> Trace:
    """Read a trace from a path, or from lines of text or of UTF-8 bytes (a file opened "rb").

    A trace with a header and no actions is read (a recorder that saw nothing writes
    one); :attr:`Trace.actions` is then 0, and ``tangram simulate`` refuses it.

    :raises TraceFormatError: the first malformed line, with its number, the reason and,
        when read from a path, the file.
    :raises SettingTypeError: ``source`` is neither a path nor lines (a ``TypeError``).
    :raises OSError: the file cannot be opened or read.
    """
    if isinstance(source, (str, Path)):
        with open(source, "rb") as handle:
            return read_lines(handle, str(source))
    if isinstance(source, (bytes, bytearray)) or not isinstance(source, Iterable):
        raise SettingTypeError(
            f"`source` must be a path or lines of text or bytes (got {_cut(repr(source), 60)})"
        )
    return read_lines(source)


def read_lines(lines: Iterable[str] | Iterable[bytes], where: str | None = None) -> Trace:
    """:func:`read_trace` for lines from ``where`` (a file's name, ``<stdin>``), named in errors.

    :raises TraceFormatError: as :func:`read_trace`.
    """
    try:
        return _parse(enumerate(lines, start=1))
    except TraceFormatError as exc:
        if where is None:
            raise
        raise TraceFormatError(exc.reason, exc.line, where) from None


def _parse(lines: Iterable[tuple[int, str | bytes]]) -> Trace:
    header: Mapping[str, Any] | None = None
    capacity: dict[str, float] = {}
    services: dict[str, Mapping[str, Any]] = {}
    trajectories: dict[str, dict[int, TraceAction]] = {}
    for number, raw in lines:
        obj = _json_line(number, raw)
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise TraceFormatError("each line must be a JSON object", number)
        if header is None:
            header = obj
            capacity, services = _header(number, obj)
            continue
        action = _action(number, obj, capacity, services)
        indexed = trajectories.setdefault(action.trajectory, {})
        if action.index in indexed:
            raise TraceFormatError(
                f"trajectory {_shown(action.trajectory)} has index {action.index} twice "
                f"(first on line {indexed[action.index].line})",
                number,
            )
        indexed[action.index] = action
    if header is None:
        raise TraceFormatError("the trace is empty: the first line must be the header", 0)
    per_device = header.get("gpu_mem_gib_per_device", DEFAULT_GPU_MEM_GIB)
    return Trace(
        name=header.get("name", ""),
        capacity=capacity,
        services=services,
        gpu_mem_gib_per_device=float(per_device),
        trajectories={
            name: tuple(indexed[i] for i in sorted(indexed))
            for name, indexed in trajectories.items()
        },
    )


def _json_line(number: int, raw: str | bytes) -> Any:
    """The line's JSON value, or None for a blank or comment line.

    Every way ``json`` fails on hostile input becomes the line's error: bytes that are not
    UTF-8 (a binary file), nesting deeper than the parser recurses, an integer longer than
    Python converts (``sys.get_int_max_str_digits``).
    """
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceFormatError(
                f"not UTF-8 text (byte {exc.start + 1} is {raw[exc.start : exc.start + 1]!r})",
                number,
            ) from None
    text = raw.strip()
    if not text or text.startswith("#"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"not JSON ({exc.msg} at column {exc.colno})", number) from None
    except RecursionError:
        raise TraceFormatError("not JSON this parser reads (nested too deeply)", number) from None
    except ValueError as exc:  # an integer literal past the conversion limit
        raise TraceFormatError(f"not JSON this parser reads ({exc})", number) from None


def _shown(value: object) -> str:
    """``repr(value)``, cut short: a message quotes a bad value, not a whole line of it."""
    return _cut(repr(value), 60)


def _cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _number(
    line: int,
    obj: Mapping[str, Any],
    key: str,
    *,
    minimum: float = 0.0,
    maximum: float = math.inf,
) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceFormatError(f"`{key}` must be a number (got {_shown(value)})", line)
    try:
        number = float(value)
    except OverflowError:  # an integer past any float: as infinite as 1e999
        number = math.inf
    if not math.isfinite(number) or number < minimum:
        raise TraceFormatError(
            f"`{key}` must be finite and >= {minimum:g} (got {_shown(value)})", line
        )
    if number > maximum:
        raise TraceFormatError(
            f"`{key}` must be at most {maximum:g} (got {_shown(value)}): the simulated clock "
            "would round shorter times away",
            line,
        )
    return number


def _seconds(line: int, obj: Mapping[str, Any], key: str) -> float:
    return _number(line, obj, key, maximum=LONGEST_SECONDS)


def _header(line: int, obj: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    if obj.get("format") != FORMAT:
        raise TraceFormatError(
            f'the header must say "format": "{FORMAT}" (got {_shown(obj.get("format"))})', line
        )
    if not isinstance(obj.get("name", ""), str):
        raise TraceFormatError(f"`name` must be a string (got {_shown(obj['name'])})", line)
    raw = obj.get("capacity")
    if not isinstance(raw, dict) or not raw:
        raise TraceFormatError("the header needs a non-empty `capacity` object", line)
    capacity = {str(kind): _number(line, raw, kind) for kind in raw}
    services = obj.get("services", {})
    if not isinstance(services, dict):
        raise TraceFormatError("`services` must be an object", line)
    per_device = (
        _number(line, obj, "gpu_mem_gib_per_device", minimum=1e-9)
        if "gpu_mem_gib_per_device" in obj
        else DEFAULT_GPU_MEM_GIB
    )
    for name, spec in services.items():
        if not name:
            raise TraceFormatError("a service needs a non-empty name", line)
        if not isinstance(spec, dict):
            raise TraceFormatError(f"service {_shown(name)} must be an object", line)
        for key in ("gpus", "gpu_mem_gib"):
            if key in spec:
                _number(line, spec, key)
        for key in ("restore_seconds", "cold_start_seconds"):
            if key in spec:
                _seconds(line, spec, key)
        for key in ("gpus", "max_batch"):
            count = spec.get(key, 1)
            if key in spec:
                _number(line, spec, key)
            if count != int(count) or count < 1:
                raise TraceFormatError(
                    f"service {_shown(name)}: `{key}` must be a whole number >= 1 "
                    f"(got {_shown(count)})",
                    line,
                )
        if spec.get("gpus", 1) > capacity.get("gpu", 0):
            raise TraceFormatError(
                f"service {_shown(name)} needs {spec.get('gpus', 1):g} GPUs, more than the "
                f"capacity's {capacity.get('gpu', 0):g}",
                line,
            )
        if spec.get("gpu_mem_gib", 0) > per_device * spec.get("gpus", 1):
            raise TraceFormatError(
                f"service {_shown(name)}: `gpu_mem_gib` {spec['gpu_mem_gib']:g} is more than "
                f"its GPUs hold ({per_device:g} GiB each, `gpu_mem_gib_per_device`)",
                line,
            )
    return capacity, dict(services)


def _action(
    line: int, obj: Mapping[str, Any], capacity: Mapping[str, float], services: Mapping[str, Any]
) -> TraceAction:
    for key in ("trajectory", "index", "gap", "kind", "resource"):
        if key not in obj:
            raise TraceFormatError(f"an action needs `{key}`", line)
    trajectory, kind, resource = obj["trajectory"], obj["kind"], obj["resource"]
    for key, value in (("trajectory", trajectory), ("kind", kind), ("resource", resource)):
        if not isinstance(value, str) or not value:
            raise TraceFormatError(
                f"`{key}` must be a non-empty string (got {_shown(value)})", line
            )
    index = obj["index"]
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise TraceFormatError(f"`index` must be a whole number >= 0 (got {_shown(index)})", line)
    if resource not in capacity:
        raise TraceFormatError(
            f"`resource` {_shown(resource)} is not in the header's capacity", line
        )
    if "units" in obj:
        if "min" in obj or "max" in obj:
            raise TraceFormatError("give `units` or `min` and `max`, not both", line)
        low = high = _number(line, obj, "units", minimum=1e-9)
    elif "min" in obj and "max" in obj:
        low, high = _number(line, obj, "min", minimum=1e-9), _number(line, obj, "max")
        if high < low:
            raise TraceFormatError(f"`max` must be >= `min` (got {high:g} < {low:g})", line)
        if high > low and (low != int(low) or high != int(high)):
            raise TraceFormatError("an elastic action's `min` and `max` must be whole", line)
    else:
        raise TraceFormatError("an action needs `units`, or `min` and `max`", line)
    if high > MOST_UNITS:
        raise TraceFormatError(f"`max` must be at most 2**53 (got {high:.3g})", line)
    held = _is_held(resource)
    if not held and high > low:  # a rate action takes one amount of tokens
        raise TraceFormatError(f"an action on the rate {_shown(resource)} takes `units`", line)
    limit = capacity[resource] if held else max(1.0, capacity[resource])
    if low > limit:
        raise TraceFormatError(f"needs {low:g} {resource}, more than the capacity {limit:g}", line)
    if "seconds_at_1" in obj:
        seconds = _seconds(line, obj, "seconds_at_1")
    elif "seconds" in obj:
        if high > low:
            raise TraceFormatError("an elastic action needs `seconds_at_1`, not `seconds`", line)
        seconds = _seconds(line, obj, "seconds")
    else:
        raise TraceFormatError("an action needs `seconds_at_1` (or `seconds` if rigid)", line)
    efficiency: Efficiency = Linear()
    if "efficiency" in obj:
        try:
            efficiency = efficiency_from_dict(obj["efficiency"])
        except (InvalidDemandError, OverflowError) as exc:
            raise TraceFormatError(f"`efficiency`: {_cut(str(exc))}", line) from None
    service = obj.get("service")
    if service is not None and not isinstance(service, str):
        raise TraceFormatError(f"`service` must be a string (got {_shown(service)})", line)
    if service is not None:
        # Checked here, with the line, not where the simulator meets it halfway through.
        if service not in services:
            raise TraceFormatError(
                f"`service` {_shown(service)} is not in the header's services", line
            )
        if resource != "gpu":
            raise TraceFormatError("an action on a `service` needs `resource` gpu", line)
        gpus = services[service].get("gpus", 1)
        if low != high or low != gpus:
            raise TraceFormatError(
                f"an action on {_shown(service)} holds its replica's {gpus:g} GPUs "
                f"(got {_shown(low if low == high else [low, high])})",
                line,
            )
    mem = _number(line, obj, "mem_gib") if "mem_gib" in obj else 0.0
    if mem and resource == "mem":
        raise TraceFormatError("an action on `mem` gives its amount once, not `mem_gib` too", line)
    if mem and "mem" in capacity and mem > capacity["mem"]:
        raise TraceFormatError(
            f"`mem_gib` {mem:g} is more than the capacity's `mem` {capacity['mem']:g}", line
        )
    return TraceAction(
        trajectory=trajectory,
        index=index,
        gap=_seconds(line, obj, "gap"),
        kind=kind,
        resource=resource,
        min=low,
        max=high,
        seconds_at_1=seconds,
        efficiency=efficiency,
        service=service,
        mem_gib=mem,
        line=line,
    )
