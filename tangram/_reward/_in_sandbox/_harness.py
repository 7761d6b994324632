"""The trusted half of the code reward: the program that judges an answer inside the sandbox.

:mod:`.._grade` sends this file's *source*, joined with those of :mod:`._checks` (the
comparisons), :mod:`._wire` (the values sent) and :mod:`._fork` (the answer's processes),
and a call of :func:`main`, into the sandbox and runs it as ``python -I -c PROGRAM`` with
the payload on stdin; tangram itself never runs :func:`main` in its own process. The
verdict must not be the exit status of a process the answer controls, so:

- the harness never imports or execs the answer: the answer runs in a child process of its
  own (forked by :class:`._fork.Forker`, made before the payload was read), which holds
  none of the harness's file descriptors and whose stdout is not the harness's;
- before it reads its stdin the harness makes itself non-dumpable, so a process of the same
  user (the answer) can neither trace it nor open its ``/proc/<pid>/mem``, ``fd/`` or
  ``environ``: the per-call secret and the tests it read from stdin stay out of reach;
- assertion tests run *here*, against proxies: a call of the answer's function sends the
  arguments to the answer's process and decodes what comes back into plain Python data
  (:func:`._wire.decode` builds only literals), so an object with a forged ``__eq__``, a
  patched builtin or a trace function in the answer's process changes nothing here;
- its only output is two lines carrying the secret: ``<secret> {"started": true}`` when
  the payload is read, ``<secret> {"passed": n, "total": m}`` at the end. Whatever ends
  the harness early (the answer killing or stopping it) leaves no verdict, which scores 0.

Python 3.10 or later on Linux (``prctl``, ``memfd_create``); standard library only, since
it runs on the sandbox's interpreter, not tangram's.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import json
import os
import select
import sys
import time
from collections.abc import Callable, Mapping, Sequence

if __name__ != "__main__":  # imported by tangram; in the sandbox the program holds them
    from typing import Any

    from ._checks import call_passed, count_tests, same_output, test_plan
    from ._fork import Child, Forker
    from ._wire import decode, encode

__all__ = ["main"]

_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3
_REPLY_LIMIT = 16 << 20
_OUTPUT_LIMIT = 8 << 20
_MESSAGE_LIMIT = 1000

# -- the harness -----------------------------------------------------------------------------


class AnswerError(Exception):
    """The answer's process could not give a result (it raised, died, hung, or lied)."""


def _exception(name: Any, message: Any, kinds: Any = None, args: Any = None) -> Exception:
    """What a call raises here when the answer's function raised ``name``.

    The builtin ``Exception`` subclass nearest its class (its own, else the first of its
    bases, ``kinds``, that is one), made from its ``args`` where they came as data, so
    ``except ValueError`` catches a ``json.JSONDecodeError`` and ``str(e)`` and ``e.args``
    are as raised (a ``KeyError('x')`` rebuilt from its text said ``"'x'"``). Never one
    that steers control flow: ``GeneratorExit``, ``KeyboardInterrupt`` and ``SystemExit``
    (not ``Exception``s), nor ``StopIteration`` and ``StopAsyncIteration``, which raised
    inside ``map``'s or a generator's ``__next__`` end the iteration silently
    (``all(map(...))`` saw nothing false): those become an :class:`AnswerError`, as
    PEP 479 makes one leaving a generator a ``RuntimeError``.
    """
    text = message[:_MESSAGE_LIMIT] if type(message) is str else ""
    label = name[:100] if type(name) is str else "an exception"
    said = args if type(args) is tuple else (text,)
    bases = [k for k in kinds[:64] if type(k) is str] if type(kinds) is list else []
    for kind in (label, *bases):
        found = getattr(builtins, kind, None)
        if not (
            isinstance(found, type)
            and issubclass(found, Exception)
            and not issubclass(found, (StopIteration, StopAsyncIteration))
        ):
            continue
        for given in (said, (text,)):
            try:
                error = found(*given)
            except Exception:
                continue
            if isinstance(error, found):
                return error
    return AnswerError(f"{label}: {text}")


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


_FORKER: Forker | None = None
"""Makes the answer's processes (:mod:`._fork`); started before the payload is read."""


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
        self._buffer = bytearray()
        self._requests = -1
        self._replies = -1

    def close(self) -> None:
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
            why = error[:_MESSAGE_LIMIT] if type(error) is str else "no reason given"
            self.failed = f"the answer did not load: {why}"
            self.close()
            raise AnswerError(self.failed)

    def _note(self, reply: Mapping[str, Any]) -> None:
        said = reply.get("binds")
        if type(said) is list:
            self.binds.update(name for name in said if type(name) is str)

    def _check_plans(self) -> None:
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
    ) -> Any:
        """``target(*args, **kwargs)`` in the answer's process: its result, as plain data.

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
            self._check_plans()
        request = {
            "target": target,
            "method": method,
            "args": encode(list(args), _handle_of),
            "kwargs": encode(dict(kwargs), _handle_of),
            "solution": solution,
            # Whether the tests capture each stream now: only then is what the call prints
            # recorded and sent (it overfilled the reply where nothing would read it).
            "capture": [sys.stdout is not sys.__stdout__, sys.stderr is not sys.__stderr__],
        }
        until = self.deadline.case()
        try:
            self._send(json.dumps(request).encode() + b"\n", until)
            reply = self._receive(until)
            self._note(reply)
            self._check_plans()
            _print(reply)
            if reply.get("ok") is True:
                value = decode(reply.get("value"), self._remote, lazy=self._lazy)
                after = reply.get("args")
                # Only a call that returns None changes its arguments here, as Python's
                # own in-place functions do (``list.sort``): an answer that returned a
                # value and emptied its argument rewrote what ``f(xs) == sum(xs)``
                # compared it with, in one statement or the next.
                if value is None and type(after) is dict:
                    _update(args, after, self._remote)
                return value
        except (AnswerError, ValueError, TypeError, KeyError, RecursionError, MemoryError) as exc:
            # A process that hung, died or garbled its reply is not trusted with the next
            # call: it is killed, and the next call starts a new one.
            self.close()
            raise AnswerError(f"no result: {exc}"[:_MESSAGE_LIMIT]) from None
        try:
            raised = decode(reply.get("raised"), self._remote, lazy=self._lazy)
        except (ValueError, TypeError, KeyError, RecursionError, MemoryError):
            raised = None
        raise _exception(
            reply.get("error"),
            reply.get("message"),
            reply.get("kinds"),
            tuple(raised) if type(raised) is list else None,
        )

    def _remote(self, number: int) -> Remote:
        return Remote(self, number, self.generation)

    def _lazy(self, number: int) -> Items:
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


def _update(args: Sequence[Any], after: Mapping[str, Any], remote: Callable[[int], Any]) -> None:
    """Mutations the answer made to list, dict, set and bytearray arguments, made here."""
    for key, data in after.items():
        index = int(key)
        if not 0 <= index < len(args):
            continue
        original, new = args[index], decode(data, remote)
        if type(original) is not type(new):
            continue
        if isinstance(original, (list, bytearray)):
            original[:] = new
        elif isinstance(original, (dict, set)):
            original.clear()
            original.update(new)


class Function:
    """What a test sees for one of the answer's names: calling it calls the answer."""

    def __init__(
        self, answer: Answer, name: str, *, solution: bool = False, builds: bool = True
    ) -> None:
        self._answer = answer
        self._name = name
        self._solution = solution
        self._builds = builds and name in answer.classes
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._answer.call(self._name, None, args, kwargs, solution=self._solution)
        if isinstance(result, Remote) and self._builds:
            result._constructed = True
        return result


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

    def __iter__(self) -> Items:
        return self

    def __next__(self) -> Any:
        if not self._items:
            if self._done:
                raise StopIteration
            got = self._answer.call(self._number, "__take__", [1], {}, generation=self._generation)
            if not (type(got) is tuple and len(got) == 2 and type(got[0]) is list):
                raise AnswerError("the answer's iterator sent no items")
            items, done = got
            if len(items) > 1 or (not items and done is not True):
                raise AnswerError("the answer's iterator sent no items")
            self._items, self._done = items, done is True
            if not self._items:
                raise StopIteration
        return self._items.pop()

    def __repr__(self) -> str:
        return f"<the answer's iterator {self._number}>"


# What the tests may call on a builtin value: on one of the answer's objects they are the
# answer's to answer, so ``f(x).startswith("Hello")`` passed for any object whose
# ``startswith`` said yes (issue #27's second review).
_VALUE_METHODS = frozenset(
    name
    for kind in (str, bytes, bytearray, list, tuple, dict, set, frozenset, int, float, complex)
    for name in dir(kind)
    if not name.startswith("_")
)


class Remote:
    """One of the answer's objects, which stays in its process: its methods can be called.

    A method named like one of a builtin value's (``startswith``, ``issubset``, ``pop``)
    only on an object the tests built by calling one of the answer's classes
    (``Stack().pop()``): elsewhere the tests expected a value, and a value would have
    come as data.
    """

    def __init__(self, answer: Answer, number: int, generation: int) -> None:
        self._answer = answer
        self._number = number
        self._generation = generation
        self._constructed = False

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _VALUE_METHODS and not self._constructed:
            raise AttributeError(f"{name}: the answer returned an object, not a value")

        def method(*args: Any, **kwargs: Any) -> Any:
            return self._answer.call(self._number, name, args, kwargs, generation=self._generation)

        return method

    # Python's protocols, on an object the tests built, as its methods are: a right
    # ``Stack`` whose tests read ``len(s)``, ``list(s)``, ``s[0]`` or ``str(s)`` scored 0.
    # Each is the answer's builtin of that protocol on its object (``len(obj)`` there),
    # its result decoded as data; Python checks its type here as on any object.
    # Comparison and hashing stay this object's own: a forged ``__eq__`` is the oldest hack.

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


def _parse(source: str) -> list[ast.stmt]:
    """The answer's top-level statements, read as text, never run; none where it does not
    parse (it then fails its tests when it runs)."""
    try:
        return ast.parse(source).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []


def _top_level_names(body: Sequence[ast.stmt], *, imports: bool = True) -> set[str]:
    """Names the answer binds at its top level (``def sum``, ``max = ...``, imports),
    dunders left out (``__name__ = "x"`` skipped every ``__main__`` block of the tests)."""
    kept = [s for s in body if imports or not isinstance(s, (ast.Import, ast.ImportFrom))]
    return {name for name in _bound(kept) if not _dunder(name)}


def _bound(body: Sequence[ast.stmt]) -> set[str]:
    """Names these top-level statements bind: definitions, imports, assignments."""
    names: set[str] = set()
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in stmt.names)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                names.update(
                    node.id
                    for node in ast.walk(target)
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
                )
    return names


def _helpers(suite: Mapping[str, Any], entry_point: str | None) -> tuple[ast.Module, bool]:
    """The dataset's own definitions the tests lean on: the prompt's, but the entry point;
    and whether the prompt declares the entry point a function (``def``).

    HumanEval's tests compute what they expect with the prompt's helpers
    (``encode_cyclic(s)``, then ``candidate(encoded) == s``): read as the answer's, an
    answer defining both as the identity scored 1.0 (issue #27's second review).
    """
    source = suite.get("helpers")
    body = ast.parse(source, "<prompt>").body if source else []
    stub = [
        stmt
        for stmt in body
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == entry_point
    ]
    kept = [stmt for stmt in body if stmt not in stub]
    return ast.Module(body=kept, type_ignores=[]), bool(stub)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _free_names(tree: ast.Module, shadowed: frozenset[str] | set[str] = frozenset()) -> set[str]:
    """Names the tests read that nothing at their top level binds: the answer's names.

    Builtins are the tests' own, except those in ``shadowed``: the readings
    (:func:`_readings`) decide which builtins the answer binds for the tests. Dunder
    names (``__name__``) are never the answer's.
    """
    bound: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(stmt.name)
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound.add(node.id)
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in stmt.names)
    loaded = {
        node.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and not _dunder(node.id)
    }
    return loaded - bound - (set(dir(builtins)) - shadowed)


def _readings(
    tree: ast.Module, binds: set[str], entry_point: str | None
) -> tuple[list[frozenset[str]], frozenset[str]]:
    """The builtins the answer's names replace, in each way the tests may be read; and
    the builtins the tests use that every reading takes as the real ones.

    Read as one module (the classic recipe), the tests call whatever the answer binds,
    builtins included: right where the task's own function is named
    ``sum``, but an answer adding ``def abs(x): return 0`` then decided what HumanEval's
    ``abs(candidate(x) - y) < 1e-6`` computed, and ``range = lambda *a: []`` emptied the
    loop that held every assert. Read with the real builtins, the first case scores any
    ``sum`` 1.0. Neither reading is safe alone, and nothing tells them apart (the tests
    may use ``sum`` both to call the answer and to compute what it should return), so a
    contested name gives two readings and a test passes only where it passes in both:
    never more than either alone. The entry point is the answer's in both.

    ``binds`` is what the answer's top level binds as read here, and what its processes
    said they bind as they ran: a ``def max`` under an ``if``, ``globals()["max"]``, a
    ``for max in ...`` or a patched ``builtins.max`` bind it too, which no reading of
    the source sees whole.
    """
    loaded = {
        node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not _dunder(node.id)
    }
    used = (loaded & set(dir(builtins))) - {entry_point or ""}
    contested = frozenset(binds & used)
    return ([frozenset(), contested] if contested else [frozenset()]), frozenset(used - contested)


_Plan = tuple[list[tuple[ast.Module, bool]], bool, "dict[str, Any]"]


def _assert_plans(suite: Mapping[str, Any], answer: Answer) -> list[_Plan]:
    """The test steps and a namespace per reading (:func:`_readings`), made before the
    answer runs.

    Once it runs, the answer can lower this process's limits (``prlimit`` needs only the
    same uid): an import that then failed to open its file made a wrong answer's 0 an
    infrastructure failure. So every module the tests name is imported first.
    """
    entry_point = suite.get("entry_point")
    tree, steps, check = test_plan(suite["source"], entry_point)
    # An entry point the prompt declares with ``def`` is a function, whatever the answer
    # makes it: calling an answer's class of that name builds no object the tests chose.
    helpers, declared = _helpers(suite, entry_point)
    theirs = _bound(helpers.body)
    # Names the answer defines itself (not imports): a task's ``def copy`` is the
    # answer's, not the module ``copy`` the tests would otherwise be handed.
    defined = _top_level_names(answer.body, imports=False)
    plans = []
    readings, answer.watch = _readings(
        tree, _top_level_names(answer.body) | answer.binds, entry_point
    )
    for shadowed in readings:
        # ``__main__``: tests often end in ``if __name__ == "__main__": check(...)``,
        # which under any other name was counted as a test and never ran.
        namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        exec(compile(helpers, "<prompt>", "exec"), namespace)
        for name in _free_names(tree, shadowed) - theirs:
            # Tests often lean on the answer's ``import math``; they get the real module.
            if name in sys.stdlib_module_names and name not in defined:
                try:
                    namespace[name] = __import__(name)
                    continue
                except ImportError:
                    pass
            # With an entry point, it alone is the answer's: any other name the tests
            # use but neither they nor the prompt define is a helper the answer must not
            # decide (``encode_cyclic``); without the prompt, such a test fails.
            if not entry_point:
                namespace[name] = Function(answer, name)
        if entry_point:
            namespace[entry_point] = Function(answer, entry_point, builds=not declared)
        plans.append((list(steps), bool(check), namespace))
    return plans


class _Rebound(BaseException):
    """The answer bound a builtin the tests use after the plans read it as the real one
    (a call ran ``global max; max = ...``): the tests are planned and run again."""


class _Ended(Exception):
    """The tests ended the program (``sys.exit``, ``exit()``): ``ok`` for a status of 0."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok


def _run(code: Callable[[], object]) -> bool:
    """Whether one step of the tests ran without raising.

    :raises _Ended: the tests called ``sys.exit``. Only the tests can: the answer's
        exceptions are rebuilt here without ``SystemExit`` (see :func:`_exception`).
    """
    try:
        code()
    except SystemExit as exc:
        raise _Ended(exc.code in (None, 0)) from None
    except Exception:
        return False
    return True


def _run_asserts(suite: Mapping[str, Any], plan: _Plan, results: list[bool]) -> None:
    """Whether each test passed, appended to ``results`` in order (``check(entry_point)``
    last) as each ends: a run cut short (:class:`_Rebound`) leaves those that ended.

    Tests that end the program (``check(f); exit(0)``) end here too: as in one program,
    what comes after counts as the status says, all passed for 0, all failed otherwise.
    """
    entry_point = suite.get("entry_point")
    steps, check, namespace = plan
    total = sum(is_test for _, is_test in steps) + bool(check and entry_point)
    broken = False
    try:
        for step, is_test in steps:
            if broken and is_test:
                results.append(False)
                continue
            code = compile(step, "<tests>", "exec")
            ok = _run(lambda code=code: exec(code, namespace))  # type: ignore[misc]
            broken = broken or (not ok and not is_test)
            if is_test:
                results.append(ok)
        if check and entry_point:
            results.append(not broken and _run(lambda: namespace["check"](namespace[entry_point])))
    except _Ended as end:
        results += [end.ok] * (total - len(results))


def _run_readings(
    suite: Mapping[str, Any], plans: Sequence[_Plan], answer: Answer, kept: list[bool | None]
) -> int:
    """Tests passed every time they ran: in every reading of every round.

    ``kept`` is each test's result so far (None: not run yet), over the rounds the
    answer ended (:class:`_Rebound`) too, those cut short included. A round that started
    over forgetting them was a retry the answer chose: it noted (in a file) where the
    tests stopped, or what the second reading handed its builtins (``sorted(expected)``),
    then bound a builtin the tests use to start over, and answered from what it learnt
    (a wrong answer scored 1.0). Each reading starts a new answer process, so no state
    one reading left in it decides the next.
    """
    for number, plan in enumerate(plans):
        if number:
            answer.close()
        results: list[bool] = []
        try:
            _run_asserts(suite, plan, results)
        finally:
            for index, ok in enumerate(results):
                before = kept[index]
                kept[index] = ok if before is None else before and ok
    return sum(ok is True for ok in kept)


def _run_calls(suite: Mapping[str, Any], answer: Answer) -> int:
    passed = 0
    name = suite["fn_name"]
    for case in suite["cases"]:
        # The result is the answer's data: whatever it does to the comparison (``str()``
        # of a 5000-digit int raises) fails this case, never the harness.
        try:
            result = answer.call(name, None, case["args"], {}, solution=True)
            passed += call_passed(result, case["expected"])
        except Exception:
            continue
    return passed


def _run_main(source: bytes, stdin: bytes, until: float) -> tuple[int | None, bytes]:
    """Run the answer as a program on ``stdin``: its exit status and stdout (or None)."""
    source_fd, stdin_fd = _memfd("answer", source), _memfd("stdin", stdin)
    out, into = os.pipe()
    try:
        process = _spawn("main", (source_fd, stdin_fd, into), until)
    except BaseException:
        os.close(out)
        raise
    finally:
        for fd in (source_fd, stdin_fd, into):
            os.close(fd)
    os.set_blocking(out, False)
    output = bytearray()
    try:
        return _collect(process, out, output, until)
    except MemoryError:
        # The answer ran: it capped this process's memory and then printed past it.
        return None, b""
    finally:
        process.kill()
        os.close(out)


def _collect(process: Child, out: int, output: bytearray, until: float) -> tuple[int | None, bytes]:
    """The answer program's exit status and stdout, read from ``out`` until ``until``."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return None, b""
        readable, _, _ = select.select([out], [], [], min(left, 0.05))
        if readable:
            try:
                chunk = os.read(out, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                break
            output += chunk
            if len(output) > _OUTPUT_LIMIT:
                return None, b""
        elif process.poll() is not None:
            # Exited: what it forked into its group goes too, closing their copies of
            # the pipe; one that left the group keeps it open until the deadline.
            try:  # noqa: SIM105 (contextlib is a tenth of the harness's start)
                os.killpg(process.pid, 9)
            except OSError:
                pass
    code = process.wait(max(0.0, until - time.monotonic()))
    return (None, b"") if code is None else (code, bytes(output))


def _run_stdio(suite: Mapping[str, Any], source: str, deadline: _Deadline) -> int:
    # Every buffer made before the answer first runs: it may cap this process's memory.
    program = source.encode()
    cases = [(case["stdin"].encode(), case["stdout"]) for case in suite["cases"]]
    passed = 0
    for stdin, want in cases:
        if time.monotonic() >= deadline.end:
            break
        try:
            code, out = _run_main(program, stdin, deadline.case())
            # The output is the answer's: what it does to the comparison fails this case.
            passed += code == 0 and same_output(out.decode(errors="replace"), want)
        except Exception:
            if not _answer_ran():
                raise  # before the answer ever ran: the sandbox's failure
            # The answer may have lowered this process's limits (see ``_harness``).
            continue
    return passed


def _seal() -> str | None:
    """Make this process non-dumpable; ``None`` when done, else why it could not be."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            return f"prctl(PR_SET_DUMPABLE) failed: errno {ctypes.get_errno()}"
        if libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
            return "the harness is still dumpable"
    except (OSError, AttributeError) as exc:
        return f"cannot call prctl: {exc}"
    if sys.version_info < (3, 10) or not hasattr(os, "memfd_create"):
        return f"the harness needs Python 3.10+ on Linux (got {sys.version.split()[0]})"
    return None


_VERDICTS = 1
"""Where verdict lines go: this process's stdout, kept for them alone (see ``_harness``)."""


def _emit(secret: str, message: Mapping[str, Any]) -> None:
    view = memoryview(f"{secret} {json.dumps(message)}\n".encode())
    while view:
        view = view[os.write(_VERDICTS, view) :]


def _keep_stdout_for_verdicts() -> None:
    """Send what the tests print to ``/dev/null``, keeping stdout for verdict lines.

    A test that prints the answer's result shared the stream the sandbox caps (1 MiB by
    default): a result sized to put the cut inside the verdict line made it unreadable,
    and the wrong answer an infrastructure failure.
    """
    global _VERDICTS
    _VERDICTS = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)


def _judge(payload: Mapping[str, Any], total: int) -> int:
    """Tests passed of ``total`` (the suite's, counted once by the caller)."""
    suite = payload["tests"]
    deadline = _Deadline(float(payload["budget"]), float(payload["case_timeout"]))
    if suite["kind"] == "stdio":
        return _run_stdio(suite, payload["answer"], deadline)
    answer = Answer(payload["answer"], deadline)
    if suite["kind"] == "call":
        try:
            answer.start()
            return _run_calls(suite, answer)
        finally:
            answer.close()
    plans = _assert_plans(suite, answer)
    kept: list[bool | None] = [None] * total
    try:
        answer.start()
        while True:  # each round contests one more name at least: at most one per builtin
            if answer.binds & answer.watch:
                plans = _assert_plans(suite, answer)
            try:
                return _run_readings(suite, plans, answer, kept)
            except _Rebound:
                answer.close()
    finally:
        answer.close()


def _error() -> str:
    import traceback  # only here: its import is a tenth of the harness's start

    return traceback.format_exc(limit=5)


def _harness() -> None:
    global _FORKER
    # Sealed first: until then another process of this user could open our stdin.
    sealed = _seal()
    # Before a byte of the payload is read: the forker must hold neither it nor stdout.
    try:
        _FORKER = Forker()
    except OSError:
        _FORKER = None  # reported below, once the secret is known
    _keep_stdout_for_verdicts()
    raw = sys.stdin.buffer.read()
    head, _, body = raw.partition(b"\n")
    secret = head.decode("ascii", "replace")
    if sealed is None and _FORKER is None:
        sealed = "the harness could not fork its answer processes' forker"
    if sealed is not None:
        _emit(secret, {"error": sealed})
        return
    try:
        payload = json.loads(body)
        total = count_tests(payload["tests"])
    except Exception:
        _emit(secret, {"error": _error()})
        return
    _emit(secret, {"started": True})
    try:
        passed = _judge(payload, total)
    except Exception as exc:
        if not _answer_ran():
            # Before any of the answer ran, nothing but tangram or the sandbox failed.
            _emit(secret, {"error": _error()})
            return
        # The answer shares this process's uid: it may have lowered any of its limits
        # (``prlimit``: memory, files, processes, file size, stack), so from its first
        # run on, a failure here is its doing and costs it the tests, never the step.
        # ``fault`` keeps what happened for the host's log.
        _emit(secret, {"passed": 0, "total": total, "fault": type(exc).__name__})
        return
    _emit(secret, {"passed": passed, "total": total})


def main() -> None:
    _harness()
    # Verdicts went out with ``os.write``: nothing to flush, and an interpreter's
    # shutdown (a third of a millisecond per module) is not the step's to wait for.
    os._exit(0)
