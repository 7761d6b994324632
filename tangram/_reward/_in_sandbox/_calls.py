"""The harness's side of a call into the answer's process, and what crosses it.

Part of the harness (:mod:`._harness`), joined into the one program the sandbox runs, so
it imports nothing but the standard library and has no ``from __future__`` import (see
:mod:`._checks`). Here: the answer's process for call tests (:class:`Answer`, made by
the forker of :mod:`._fork`), and the tests' stand-ins for what it holds: its functions
(:class:`Function`), its objects (:class:`Remote`) and iterators (:class:`Items`), the
exceptions it raised (:func:`_exception`) and what its calls printed (:func:`_print`).
Nothing the answer's process sends is trusted beyond the data :func:`._wire.decode` builds.
"""

import ast
import collections
import json
import os
import select
import sys
import time
from collections.abc import Callable, Mapping, Sequence

if __name__ != "__main__":  # imported by tangram; in the sandbox the program holds them
    from typing import Any

    from ._fork import Child, Forker
    from ._kept import Shared, refill_parts
    from ._raised import MESSAGE_LIMIT, AnswerError, exception_classes, rebuilt
    from ._wire import METHOD, VALUE_METHODS, decode, encode, places_of

__all__ = [
    "Answer",
    "CallableRemote",
    "Function",
    "Items",
    "Remote",
    "start_forker",
]

_REPLY_LIMIT = 16 << 20


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


_FORKER: "Forker | None" = None
"""Makes the answer's processes (:mod:`._fork`); started before the payload is read."""


def start_forker() -> bool:
    """Start the forker (:class:`._fork.Forker`): before the payload is read, so that it
    holds neither the payload nor the verdicts' stream; whether it started."""
    global _FORKER
    try:
        _FORKER = Forker()
    except OSError:
        _FORKER = None
    return _FORKER is not None


def _spawn(mode: str, fds: Sequence[int], until: float) -> Child:
    """An answer process in ``mode`` given ``fds``.

    :raises OSError: none could be made (the forker is gone, stopped or out of processes).
    """
    if _FORKER is None:
        raise OSError("no forker")
    return _FORKER.spawn(mode, fds, until)


def _answer_ran() -> bool:
    """Whether an answer process was ever made: from then on, every failure of this
    process may be the answer's doing (see :func:`_harness`)."""
    return _FORKER is not None and _FORKER.spawned


class _Deadline:
    def __init__(self, budget: float, case_timeout: float) -> None:
        self.end = time.monotonic() + budget
        self.case_timeout = case_timeout

    def case(self) -> float:
        """When the next call (or stdio case) must be done by."""
        return min(self.end, time.monotonic() + self.case_timeout)


class Answer:
    """The answer's process for call tests: started on first use, restarted after it dies.

    A load that fails (the answer's top level raised, exited, or hung) fails every later
    call without a restart: the same source would fail the same way.
    """

    def __init__(self, source: str, deadline: _Deadline) -> None:
        self.source = source.encode()
        self.deadline = deadline
        self.process: Child | None = None
        self.generation = 0
        self.failed: str | None = None
        # The text, as the answer's process compiles it: the bytes' coding cookie
        # (``# coding: bogus``) failed this parse alone, and the answer bound nothing here.
        self.body = _parse(source)
        self.binds: set[str] = set()
        """The builtins its processes said it binds (:func:`_readings`), as it ran."""
        self.watch: frozenset[str] = frozenset()
        """Builtins the tests use that the plans read as the real ones: one the answer
        binds after all ends the plans (:class:`_Rebound`)."""
        self.classes = frozenset(s.name for s in self.body if isinstance(s, ast.ClassDef))
        self._proxies: dict[tuple[int, int, type], Remote] = {}
        self._seq = 0  # calls made, each's number in its request
        self._shared = Shared()
        """The values both sides keep: earlier calls' arguments and results (``_kept``)."""
        self.answered = 0
        """Calls answered: a step cut after one of them counts (``_harness._run_asserts``)."""
        self.faithful = False
        """Whether every call's changes to its arguments are copied back, not only a
        call's that returned None (:meth:`_copy_back`)."""
        self.diverged = False
        """Whether a call changed an argument that was not copied back."""
        self.exceptions = exception_classes(self.body)
        """Its exception classes, as the tests name them (:func:`exception_classes`)."""
        self._buffer = bytearray()
        self._requests = -1
        self._replies = -1

    def close(self) -> None:
        self._proxies.clear()
        self._shared.clear()
        if self.process is not None:
            self.process.kill()
            self.process = None
        for fd in (self._requests, self._replies):
            if fd >= 0:
                os.close(fd)
        self._requests = self._replies = -1
        self._buffer.clear()

    def start(self) -> None:
        """Start the answer's process (and run its top level) before the first test.

        :raises OSError: no process could be started: before the answer has run at all,
            that is the sandbox's failure, not the answer's.
        """
        # An answer that does not load is recorded in ``failed``: every test fails.
        try:
            self._start()
        except AnswerError:
            pass
        except MemoryError:
            # The answer capped this process's memory (``prlimit`` needs only the same
            # uid), then sent more than that before saying it was ready: its failure.
            self.failed = "the answer exhausted the judge's memory"
            self.close()

    def _start(self) -> None:
        source_fd = _memfd("answer", self.source)
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            self.process = _spawn("call", (source_fd, request_r, reply_w), self.deadline.case())
        except BaseException:
            os.close(request_w)
            os.close(reply_r)
            raise
        finally:
            for fd in (source_fd, request_r, reply_w):
                os.close(fd)
        self.generation += 1
        self._requests, self._replies = request_w, reply_r
        os.set_blocking(request_w, False)
        os.set_blocking(reply_r, False)
        try:
            ready = self._receive(self.deadline.case())
        except AnswerError as exc:
            self.failed = f"the answer did not load: {exc}"
            self.close()
            raise AnswerError(self.failed) from None
        self._note(ready)
        if ready.get("ready") is not True:
            error = ready.get("error")
            why = error[:MESSAGE_LIMIT] if type(error) is str else "no reason given"
            self.failed = f"the answer did not load: {why}"
            self.close()
            raise AnswerError(self.failed)

    def _note(self, reply: Mapping[str, Any]) -> None:
        said = reply.get("binds")
        if type(said) is list:
            self.binds.update(name for name in said if type(name) is str)

    def replan(self) -> None:
        """:raises _Rebound: the answer binds a builtin the plans read as the real one."""
        if self.binds & self.watch:
            raise _Rebound

    def _send(self, data: bytes, until: float) -> None:
        view = memoryview(data)
        while view:
            left = until - time.monotonic()
            if left <= 0:
                raise AnswerError("timed out")
            _, writable, _ = select.select([], [self._requests], [], left)
            if not writable:
                continue
            try:
                view = view[os.write(self._requests, view) :]
            except BlockingIOError:
                continue
            except OSError as exc:
                raise AnswerError(f"the answer's process is gone ({exc})") from None

    def _receive(self, until: float) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            left = until - time.monotonic()
            if left <= 0:
                raise AnswerError("timed out")
            readable, _, _ = select.select([self._replies], [], [], left)
            if not readable:
                continue
            try:
                chunk = os.read(self._replies, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise AnswerError("the answer's process ended")
            self._buffer += chunk
            if len(self._buffer) > _REPLY_LIMIT:
                raise AnswerError("the answer's reply is too large")
        end = self._buffer.index(b"\n")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError, MemoryError):
            raise AnswerError("malformed reply") from None
        if type(reply) is not dict:
            raise AnswerError("malformed reply")
        return reply

    def call(
        self,
        target: str | int,
        method: str | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        generation: int | None = None,
        solution: bool = False,
        settles: bool = True,
    ) -> Any:
        """``target(*args, **kwargs)`` in the answer's process: its result, as plain data;
        what the call did to its arguments is done to the tests' by the rules of
        :meth:`_copy_back`. ``settles``: whether returning None settles what it did to
        its arguments, as an in-place function's does; an attribute the tests set does
        not (an answer's ``__setattr__`` emptied the list the tests then computed the
        expected value of), and its change to the value set waits for the faithful
        reading (a setter that sorted the tests' list, with no reading owed, passed
        their check that it was unchanged).

        :raises AnswerError: the answer could not answer (see the class).
        """
        if self.failed is not None:
            raise AnswerError(self.failed)
        if time.monotonic() >= self.deadline.end:
            raise AnswerError("out of time")
        if generation is not None and generation != self.generation:
            raise AnswerError("the object belonged to an answer process that has ended")
        if self.process is None:
            self._start()
            self.replan()
        memo: dict[int, int] = {}
        self._seq += 1
        parts = {tuple(path): part for path, part in places_of(list(args), kwargs).values()}
        # What the tests did to the values both sides keep, done there before the call.
        sync, carried = self._shared.changes(_handle_of)
        request = {
            "seq": self._seq,
            "target": target,
            "method": method,
            # One memo: an argument passed twice (``f(a, out=a)``) is one there too.
            "args": encode(list(args), _handle_of, memo=memo),
            "kwargs": encode(dict(kwargs), _handle_of, memo=memo),
            "solution": solution,
            # Whether the tests capture each stream now: only then is what the call prints
            # recorded and sent (it overfilled the reply where nothing would read it).
            "capture": [sys.stdout is not sys.__stdout__, sys.stderr is not sys.__stderr__],
            "sync": sync,
            "carried": carried,
        }
        until = self.deadline.case()
        try:
            self._send(json.dumps(request).encode() + b"\n", until)
            reply = self._receive(until)
            self._note(reply)
            self.replan()
            self.answered += 1
            self._shared.forget(reply.get("forgot"))
            _print(reply)
            if reply.get("ok") is True:
                # Copied back first: a result that holds an argument holds it as changed.
                # What a setter did to values kept from earlier calls is settled as by
                # any call that returns None (``View(d)``'s setter sorting ``d``).
                settled = reply.get("value") is None
                self._later(reply, settled)
                pending = self._copy_back(parts, reply, settles and settled)
                value = decode(
                    reply.get("value"),
                    self._remote,
                    lazy=self._lazy,
                    call=self._callable,
                    method=method == "__getattr__",
                    alias=_Aliases(args, kwargs, pending, self._shared),
                )
                self._keep(parts, pending, value)
                return value
            self._later(reply, settled=False)
            self._keep(parts, self._copy_back(parts, reply, settled=False), None)
        except (AnswerError, ValueError, TypeError, KeyError, RecursionError, MemoryError) as exc:
            # A process that hung, died or garbled its reply is not trusted with the next
            # call: it is killed, and the next call starts a new one.
            self.close()
            raise AnswerError(f"no result: {exc}"[:MESSAGE_LIMIT]) from None
        said: list[Any] = []
        for key in ("raised", "fields"):  # its args and attributes, where they are data
            try:
                said.append(decode(reply.get(key), self._remote, lazy=self._lazy))
            except (ValueError, TypeError, KeyError, RecursionError, MemoryError):
                said.append(None)
        raised, fields = said
        error, message, kinds = reply.get("error"), reply.get("message"), reply.get("kinds")
        given = tuple(raised) if type(raised) is list else None
        raise rebuilt(error, message, kinds, given, self.exceptions, fields)

    def _copy_back(
        self, parts: "dict[tuple[Any, ...], Any]", reply: Any, settled: bool
    ) -> set[str]:
        """Do to the tests' arguments what the call did to the answer's copies.

        Where the call returned None (``settled``), as Python's own in-place functions
        do (``list.sort``), or in the faithful reading (:func:`._harness._run_readings`).
        Otherwise the change waits for that reading, which the tests then must pass too:
        copied back, an answer that returned a value and emptied its argument rewrote
        what ``f(xs) == sum(xs)`` compared it with, in one statement or the next; never
        copied, one that sorted an argument the task said to leave alone passed the
        tests' check that it was unchanged, after a value or a raise.

        ``parts``: the tests' arguments' parts by their places before the call. Returns
        the arguments changed and not copied back: their index, or keyword.

        :raises ValueError: the changes came malformed.
        """
        after = reply.get("after")
        if after is None:
            return set()
        if after == "unread":
            # A change that cannot be copied back, in either reading, is no change the
            # tests can check: the call fails (a cycle it made of its argument).
            raise AnswerError("the call left its arguments past what can be read back")
        if type(after) is not dict or type(after.get("changed")) is not list:
            raise ValueError("malformed changes")
        changed = {key for key in after["changed"] if type(key) is str}
        if not changed:
            return set()
        if not (settled or self.faithful):
            self.diverged = True
            return changed
        self._refill_from(parts, after)
        return set()

    def _keep(self, parts: "dict[tuple[Any, ...], Any]", pending: set[str], value: Any) -> None:
        """Keep this call's arguments and result as the answer's process does (``_kept``)."""
        if parts:
            self._shared.keep(self._seq, parts, _handle_of)
            if pending:
                self._shared.pend(self._seq)
        if isinstance(value, (list, tuple, dict, set, bytearray, collections.deque)):
            places = places_of([value], {}).values()
            if places:
                kept = {tuple(path): part for path, part in places}
                self._shared.keep(-self._seq, kept, _handle_of)
        self._shared.rebase(_handle_of)

    def _later(self, reply: Any, settled: bool) -> None:
        """What the call did to earlier calls' arguments (``_fork._later``), done to the
        tests' where it returned None or in the faithful reading, as :meth:`_copy_back`
        does; otherwise the faithful reading is owed.

        :raises ValueError: the changes came malformed.
        """
        later = reply.get("later")
        if later is None:
            return
        if type(later) is not list:
            raise AnswerError("the call left earlier arguments past what can be read back")
        for entry in later:
            if type(entry) is not dict:
                raise ValueError("malformed changes")
            parts = self._shared.parts(entry.get("seq"))
            if parts is None:
                continue  # one this side no longer keeps (a failed call's came first)
            if settled or self.faithful:
                self._refill_from(parts, entry)
                self._shared.touched.add(entry["seq"])
            else:
                self.diverged = True
                self._shared.pend(entry["seq"])

    def _refill_from(self, parts: "dict[tuple[Any, ...], Any]", after: Any) -> None:
        """Refill the tests' ``parts`` (by their places) as ``after`` (the arguments as
        the answer's process sent them) says: each part that was there comes as its
        place (``al``), and holds the others as they are now; a new one is a copy.

        :raises ValueError: a place that is no part of the tests', or not one like it.
        """
        # One numbering for both, as they were sent: a list around them is numbered last.
        refill_parts(parts, [after.get("args"), after.get("kwargs")], self._remote)

    def _remote(self, number: int) -> "Remote":
        return self._proxy(number, Remote)

    def _callable(self, number: int) -> "Remote":
        return self._proxy(number, CallableRemote)

    def _proxy(self, number: int, kind: "type[Remote]") -> "Remote":
        """The one stand-in of the answer's object ``number`` (of this process), so that
        ``is``, identity's ``==`` and hashing are its object's: a new one each time made
        ``make() is not make()`` true where ``make`` returned one object twice."""
        key = (self.generation, number, kind)
        found = self._proxies.get(key)
        if found is None:
            found = self._proxies[key] = kind(self, number, self.generation)
        return found

    def _lazy(self, number: int) -> "Items":
        return Items(self, number, self.generation)


def _print(reply: Mapping[str, Any]) -> None:
    """What a call printed, written in its order where the tests capture stdout and
    stderr now (``redirect_stdout``); the answer's process records nothing else.

    :raises AnswerError: it printed more than the reply carries: a prefix handed over as
        the whole output would pass a comparison the whole output fails.
    """
    if reply.get("overflow") is True:
        raise AnswerError("the call printed more than the tests' capture takes")
    printed = reply.get("printed")
    if type(printed) is not list:
        return
    streams = (sys.stdout, sys.stderr)
    owns = (sys.__stdout__, sys.__stderr__)
    for run in printed:
        if type(run) is list and len(run) == 2 and run[0] in (0, 1) and type(run[1]) is str:
            stream = streams[run[0]]
            if stream is not None and stream is not owns[run[0]]:
                stream.write(run[1])


def _handle_of(value: Any) -> int:
    if isinstance(value, Remote):
        return value._number
    raise TypeError(f"cannot pass {type(value).__name__} to the answer")


class _Aliases:
    """What a result holds where the answer's held one of its call's arguments (or a
    part of one, at a place :func:`._wire.places_of` names): the tests' own, as in one
    program (``f(a) is a``, a shallow copy's inner lists), unless the call changed that
    argument and the change was not copied back (``pending``: ``Answer._copy_back``),
    where it is the copy, as it was sent. A part of an earlier call's arguments or
    result (its place headed ``[seq]``) is the tests' own by the same rule
    (``_kept.Shared.alias``): ``s.items() is s.items()`` where it returns one list."""

    def __init__(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], pending: set[str], shared: Shared
    ):
        self._arguments = (list(args), kwargs)
        self._pending = pending
        self._parts: dict[tuple[Any, ...], Any] | None = None
        self._shared = shared

    def __call__(self, place: list[Any], copy: Any) -> Any:
        """:raises ValueError: no such part of the tests' arguments, or not one like
        ``copy`` there."""
        head = place[0] if place else None
        if type(head) is list:  # a part of an earlier call's arguments or result
            return self._shared.alias(head, place[1:], copy)
        if str(head) in self._pending:
            return copy
        if self._parts is None:  # as they are after the call's changes were copied back
            self._parts = {tuple(path): part for path, part in places_of(*self._arguments).values()}
        known = all(type(step) in (int, str) for step in place)
        found = self._parts.get(tuple(place)) if known else None
        if type(found) is not type(copy):
            raise ValueError("malformed alias")
        return found


def _class_name(name: str) -> bool:
    """Whether the tests name ``name`` as a class (``Point``, ``LRUCache``), not a function
    (``add``) or a constant (``GCD``).

    The objects the tests build from the answer's classes are trusted with Python's
    protocols and operators (``Remote``); the answer decides which of its names are
    classes, the tests how they name them. Without a prompt that declares ``add`` a
    function, a ``class add`` whose every operator said yes built such an object at
    ``assert add(2, 3) == 5``, and a wrong answer scored full marks.
    """
    return name[:1].isupper() and not name.isupper()


class Function:
    """What a test sees for one of the answer's names: calling it calls the answer."""

    def __init__(
        self, answer: Answer, name: str, *, solution: bool = False, builds: bool = True
    ) -> None:
        self._answer = answer
        self._name = name
        self._solution = solution
        self._builds = builds and name in answer.classes and _class_name(name)
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._answer.call(self._name, None, args, kwargs, solution=self._solution)
        if isinstance(result, Remote) and self._builds:
            result._constructed = True
        return result

    def __instancecheck__(self, instance: Any) -> bool:
        # ``isinstance(s, Stack)``, ``assertIsInstance``: asked of the answer's class where
        # its objects are (a stand-in is no class, and ``isinstance`` raised TypeError).
        # The answer decides, as its metaclass's ``__instancecheck__`` would in one program.
        found = self._answer.call(self._name, "__instancecheck__", (instance,), {})
        if type(found) is not bool:
            raise TypeError(f"isinstance() arg 2: {self._name} is not a class of the answer")
        return found

    def __getattr__(self, name: str) -> Any:
        # Read in the answer's process, as an object's are (``Remote``): a class's static
        # method (``Geometry.area(2)``), a cache's ``fib.cache_clear()``. Names with an
        # underscore are refused: Python and the tests' libraries probe for those
        # (``_is_coroutine``, ``__wrapped__``), and a round trip each is no answer to them.
        if name.startswith("_") or self._solution:
            raise AttributeError(name)
        found = self._answer.call(self._name, "__getattr__", (name,), {})
        if found is not METHOD:
            return found

        def method(*args: Any, **kwargs: Any) -> Any:
            return self._answer.call(self._name, name, args, kwargs)

        return method


class Items:
    """An iterator the answer returned: each item is taken from the answer's process when
    the tests ask for it, as data.

    Taken all when the call returned (up to 100,000), an endless generator of growing or
    costly items failed its call, where the classic recipe takes the ten the tests ask
    for; taken ahead of the tests (a few at a time), its side effects, prints included,
    came early. It ends only where the answer's iterator ends, as in one program.
    """

    def __init__(self, answer: Answer, number: int, generation: int) -> None:
        self._answer = answer
        self._number = number
        self._generation = generation
        self._items: list[Any] = []
        self._done = False

    def __iter__(self) -> "Items":
        return self

    def __bool__(self) -> bool:
        # Its class's, as for any object of the answer's (a generator is true; read as
        # true, an empty object of its own with a ``__next__`` passed ``assert f(x)``).
        return self._answer.call(  # type: ignore[no-any-return]
            self._number, "__bool__", (), {}, generation=self._generation
        )

    def __next__(self) -> Any:
        if not self._items:
            if self._done:
                raise StopIteration
            got = self._answer.call(self._number, "__take__", (), {}, generation=self._generation)
            if not (type(got) is tuple and len(got) == 2 and type(got[0]) is list):
                raise AnswerError("the answer's iterator sent no items")
            items, done = got
            if len(items) > 1 or (not items and done is not True):
                raise AnswerError("the answer's iterator sent no items")
            self._items, self._done = list(items), done is True  # the result left whole
            if not self._items:
                raise StopIteration
        return self._items.pop()

    def __repr__(self) -> str:
        return f"<the answer's iterator {self._number}>"


# What the tests may call on a builtin value: on one of the answer's objects they are the
# answer's to answer, so ``f(x).startswith("Hello")`` passed for any object whose
# ``startswith`` said yes (issue #27's second review).
_MIRRORED = {
    "__eq__": "__eq__",
    "__ne__": "__ne__",
    "__lt__": "__gt__",
    "__le__": "__ge__",
    "__gt__": "__lt__",
    "__ge__": "__le__",
}
"""Each comparison, and the same asked of the other side (``a < b`` is ``b > a``)."""


def _answered(name: str) -> Callable[..., Any]:
    """``Remote``'s ``name`` operator (``__eq__``), answered in the answer's process."""

    def operation(self: "Remote", other: Any) -> Any:
        return self._operator(name, other)

    operation.__name__ = name
    return operation


class Remote:
    """One of the answer's objects, which stays in its process: its attributes can be
    read, as data or as more of its objects, and its methods called (the object itself
    only where the answer's process says it can be: ``CallableRemote``).

    A name like one of a builtin value's (``startswith``, ``real``, ``pop``) only on an
    object the tests built by calling one of the answer's classes (``Stack().pop()``):
    elsewhere the tests expected a value, and a value would have come as data.
    """

    def __init__(self, answer: Answer, number: int, generation: int) -> None:
        self._answer = answer
        self._number = number
        self._generation = generation
        self._constructed = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in VALUE_METHODS and not self._constructed:
            raise AttributeError(f"{name}: the answer returned an object, not a value")
        # Read in the answer's process: every name was a method to call, so a right
        # answer's ``p.x`` or ``node.next.val`` was a function and failed its test.
        found = self._answer.call(
            self._number, "__getattr__", (name,), {}, generation=self._generation
        )
        if found is not METHOD:
            return found

        def method(*args: Any, **kwargs: Any) -> Any:  # called by name (see ``METHOD``)
            return self._answer.call(self._number, name, args, kwargs, generation=self._generation)

        return method

    def __setattr__(self, name: str, value: Any) -> None:
        # Set in the answer's process, where the tests then read it (``a.balance = 0``).
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        self._answer.call(
            self._number,
            "__setattr__",
            (name, value),
            {},
            generation=self._generation,
            settles=False,
        )

    # Python's protocols, on an object the tests built, as its methods are: a right
    # ``Stack`` whose tests read ``len(s)``, ``list(s)``, ``s[0]`` or ``str(s)`` scored 0.
    # Each is the answer's builtin of that protocol on its object (``len(obj)`` there),
    # its result decoded as data; Python checks its type here as on any object.

    def _operator(self, name: str, other: Any) -> Any:
        # Comparison between two of the answer's objects where the tests built one of
        # them from its class (``Point(1, 2) == Point(1, 2)``, ``Vec(1) + Vec(2) ==
        # Vec(3)``): they trust that class's comparison there, as in one program, and it
        # alone decides (``_own`` in the answer's process). With a value on the other
        # side, or between objects the answer returned, it stays identity: a forged
        # ``__eq__`` is the oldest hack, and a function the tests name like a class
        # (MBPP's ``Split``) can be the answer's class, ``Split(xs) == [2, 4]`` built
        # by the tests' own call. Arithmetic with a built object on either side is its
        # operators', as Python runs them: what it makes is compared by these rules, and
        # with a value on the other side it must make one of its objects.
        built_side = self._constructed or (isinstance(other, Remote) and other._constructed)
        mirrored = _MIRRORED.get(name)
        if mirrored is not None:
            if isinstance(other, Remote) and built_side:
                built, against, asked = (
                    (self, other, name) if self._constructed else (other, self, mirrored)
                )
                return built._answer.call(
                    built._number, asked, (against,), {}, generation=built._generation
                )
            if name in ("__eq__", "__ne__"):
                # Said as a bool: ``NotImplemented`` is true, and the tests' own
                # ``f(x).__eq__(3)`` passed with it.
                return (self is other) == (name == "__eq__")
            return NotImplemented
        if not built_side:
            return NotImplemented
        made = self._answer.call(self._number, name, (other,), {}, generation=self._generation)
        if not isinstance(other, Remote) and not isinstance(made, Remote):
            # With a value, only more of its objects: a value of its choosing answered for
            # the value the tests expected (MBPP's ``Area(2) - 12.566`` gave 0).
            raise TypeError(f"{name}: the answer's object and a value made no object of it")
        return made

    __hash__ = object.__hash__  # identity, as an object of a class without ``__eq__``
    __eq__ = _answered("__eq__")
    __ne__ = _answered("__ne__")
    __lt__ = _answered("__lt__")
    __le__ = _answered("__le__")
    __gt__ = _answered("__gt__")
    __ge__ = _answered("__ge__")
    __add__ = _answered("__add__")
    __sub__ = _answered("__sub__")
    __mul__ = _answered("__mul__")
    __truediv__ = _answered("__truediv__")
    __floordiv__ = _answered("__floordiv__")
    __mod__ = _answered("__mod__")
    __pow__ = _answered("__pow__")
    __radd__ = _answered("__radd__")
    __rsub__ = _answered("__rsub__")
    __rmul__ = _answered("__rmul__")
    __rtruediv__ = _answered("__rtruediv__")
    __rfloordiv__ = _answered("__rfloordiv__")
    __rmod__ = _answered("__rmod__")
    __rpow__ = _answered("__rpow__")

    def _protocol(self, name: str, *args: Any) -> Any:
        if not self._constructed:
            raise TypeError(f"{name}: the answer returned an object, not a value")
        return self._answer.call(self._number, name, args, {}, generation=self._generation)

    def __len__(self) -> int:
        return self._protocol("__len__")  # type: ignore[no-any-return]

    def __bool__(self) -> bool:
        # Asked of every object, built or returned: one bit the answer could return as
        # data; read as True, an empty container of its own passed ``assert f(x)``.
        return self._answer.call(  # type: ignore[no-any-return]
            self._number, "__bool__", (), {}, generation=self._generation
        )

    def __iter__(self) -> Any:
        return iter(self._protocol("__iter__"))

    def __getitem__(self, key: Any) -> Any:
        return self._protocol("__getitem__", key)

    def __contains__(self, item: Any) -> bool:
        return self._protocol("__contains__", item)  # type: ignore[no-any-return]

    def __str__(self) -> str:
        return self._protocol("__str__") if self._constructed else repr(self)

    def __repr__(self) -> str:
        if self._constructed:
            return self._protocol("__repr__")  # type: ignore[no-any-return]
        return f"<the answer's object {self._number}>"


class CallableRemote(Remote):
    """One of the answer's objects that can be called: a function it returned
    (``make_adder(5)(3)``), a class, an object with ``__call__``. What it returns is data
    or more of its objects, as any call's."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._answer.call(
            self._number, "__call__", args, kwargs, generation=self._generation
        )


def _parse(source: str) -> list[ast.stmt]:
    """The answer's top-level statements, read as text, never run; none where it does not
    parse (it then fails its tests when it runs)."""
    try:
        return ast.parse(source).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []


class _Rebound(BaseException):
    """The answer bound a builtin the tests use after the plans read it as the real one
    (a call ran ``global max; max = ...``): the tests are planned and run again."""
