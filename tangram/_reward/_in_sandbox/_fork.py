"""The answer's processes: forked from a clean child of the harness, and what runs in them.

Part of the harness (:mod:`._harness`), joined into the one program the sandbox runs, so
it imports nothing but the standard library and has no ``from __future__`` import (see
:mod:`._checks`).

Each answer process used to be a new interpreter (``python -I -c`` of the whole harness):
its start, compile and imports were 32 ms of the 107 ms a HumanEval answer took, and a
call test's restart or an input/output case paid them again. Forking the harness itself
after it read its payload would be cheaper still, but the child would hold a copy of the
tests and the secret: ``gc.get_objects()`` would hand the answer every expected value.
So :class:`Forker` forks one child *before* the harness reads anything, the forker, which
holds no secret and no descriptor of the harness's; it makes every answer process on
request, from the harness's imports but not its data, in a millisecond or two.

The harness is the answer processes' parent (a child subreaper, and the forker's child
double-forks), so it waits for their exit status as for any child. Nothing the forker or
an answer process sends is trusted beyond a process id: an answer that stops or kills
the forker fails its own next test.
"""

import array
import builtins
import collections
import ctypes
import functools
import io
import json
import operator
import os
import select
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence

if __name__ != "__main__":  # imported by tangram; in the sandbox the program holds them
    from typing import Any

    from ._kept import arguments, refill_parts, text, unheld
    from ._raised import FIELDS
    from ._wire import (
        METHOD,
        decode,
        encode,
        places_of,
        plain_value,
    )

__all__ = ["Child", "Forker", "answer_main"]

_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_SOL_SOCKET = 1
_SCM_RIGHTS = 1
_MESSAGE_LIMIT = 1000
_FDS = 3
"""Descriptors an answer process is given: its source, then two for its mode."""


def _take(iterator: Any) -> "tuple[list[Any], bool]":
    """The next item of ``iterator``, and whether it ended (``__take__``): one at a time,
    as the tests ask, so that what it does on the way (a print, a change the tests read
    next) comes when it would in one program."""
    try:
        return [next(iterator)], False
    except StopIteration:
        return [], True


def _attribute(value: Any, name: str) -> Any:
    """``value.name`` as the tests read it (``__getattr__``): the attribute, or, where it
    can be called, :data:`._wire.METHOD`, and the harness calls it by name (a handle per
    method read would be kept for the rest of the grading)."""
    found = getattr(value, name)
    return METHOD if callable(found) else found


_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")
"""The arithmetic the tests may apply to one of the answer's objects (``Remote``)."""
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


def _own(name: str) -> "Callable[[Any, Any], Any]":
    """The comparison ``name`` of an object the tests built, asked of its class alone.

    Python asks the other side when a class says ``NotImplemented`` (a dataclass does,
    for any other class): an object the answer returned, whose ``__eq__`` says yes to
    anything, then decided ``midpoint(a, b) == Point(1, 1)``. Here it is identity for
    ``==`` and ``!=``, and a ``TypeError`` for an order, as for objects that define none.
    """

    def compare(built: Any, other: Any) -> Any:
        found = getattr(type(built), name)(built, other)
        if found is not NotImplemented:
            return found
        if name in ("__eq__", "__ne__"):
            return (built is other) == (name == "__eq__")
        raise TypeError(f"{type(built).__name__} has no {name} for {type(other).__name__}")

    return compare


def _reflected(operation: "Callable[[Any, Any], Any]") -> "Callable[[Any, Any], Any]":
    """``operation`` with the answer's object on its right (``2 + v``)."""
    return lambda value, other: operation(other, value)


_PROTOCOLS: "dict[str, Callable[..., Any]]" = {
    "__getattr__": _attribute,
    "__setattr__": setattr,
    "__len__": len,
    "__bool__": bool,
    "__iter__": iter,
    "__getitem__": operator.getitem,
    "__contains__": operator.contains,
    "__str__": str,
    "__repr__": repr,
    "__take__": _take,
    "__instancecheck__": lambda kind, value: isinstance(value, kind),
    # Comparison and arithmetic, with one of the answer's objects the tests built on
    # either side (``Point(1, 2) == Point(1, 2)``, ``V(1) + V(2)``), run where the
    # objects are: a comparison is the built object's class's (``_own``), arithmetic
    # Python's own operator, reflection included.
    **{f"__{name}__": _own(f"__{name}__") for name in _COMPARISONS},
    **{f"__{name}__": getattr(operator, name) for name in _ARITHMETIC},
    **{f"__r{name}__": _reflected(getattr(operator, name)) for name in _ARITHMETIC},
}
"""What the harness may ask of an object by name: the protocols on one the tests built
(``Remote``), an attribute of any (``__getattr__``), ``__take__`` on an iterator the
answer returned (``Lazy``), and ``isinstance`` of one of its names (``Function``)."""

_PRINTED = 1 << 20
"""Characters of what one call prints that reach the tests; past them the call fails."""


class _Record(io.TextIOBase):
    """One stream of a call that the tests capture: its writes join one ordered log. A
    text stream as ``io.StringIO`` is (``writelines``, ``closed``, no ``fileno``), which
    ``redirect_stdout`` would have put there in one program."""

    def __init__(self, printed: "_Printed", index: int) -> None:
        super().__init__()
        self._printed = printed
        self._index = index

    def write(self, text: Any) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        data = str.__add__("", text)  # a str subclass's characters, as StringIO takes them
        self._printed.add(self._index, data)
        return len(data)

    def writable(self) -> bool:
        return True


class _Printed:
    """What one call prints to the streams the tests capture (``capture``: stdout's and
    stderr's flags, sent by the harness), in the order written: ``runs`` holds
    ``[stream, pieces]``, joined once for the reply (added to a string at every write,
    a pattern printed a character at a time took quadratic time), and ``overflow`` says
    more than ``_PRINTED`` was written."""

    def __init__(self, capture: Any) -> None:
        flags = capture if type(capture) is list and len(capture) == 2 else [False, False]
        self.capture = [flag is True for flag in flags]
        self.runs: list[tuple[int, list[str]]] = []
        self.size = 0
        self.overflow = False

    def streams(self, current: "tuple[Any, Any]") -> "tuple[Any, Any]":
        return tuple(  # type: ignore[return-value]
            _Record(self, index) if self.capture[index] else stream
            for index, stream in enumerate(current)
        )

    def add(self, index: int, text: str) -> None:
        if self.overflow or not text:
            return
        self.size += len(text)
        if self.size > _PRINTED:
            self.overflow, self.runs = True, []
        elif self.runs and self.runs[-1][0] == index:
            self.runs[-1][1].append(text)
        else:
            self.runs.append((index, [text]))

    def log(self) -> "list[list[Any]]":
        """The runs, each ``[stream, text]``, for the reply."""
        return [[index, "".join(pieces)] for index, pieces in self.runs]


class Forker:
    """The child that forks the answer's processes; made before the payload is read."""

    def __init__(self) -> None:
        import _socket

        libc = ctypes.CDLL(None, use_errno=True)
        # Orphans are reparented to us: the forker's children double-fork, so each
        # answer process is this process's child, to wait for with ``waitpid``.
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            ours.close()
            _serve(theirs, libc)  # never returns
        theirs.close()
        ours.setblocking(False)
        self._socket = ours
        self._pid = pid
        self._asked = 0
        self.spawned = False
        """Whether an answer process was ever made: from then on, a failure of the
        harness may be the answer's doing (it shares the harness's uid)."""

    def spawn(self, mode: str, fds: Sequence[int], until: float) -> "Child":
        """An answer process running in ``mode`` (``call`` or ``main``) with ``fds``.

        :raises OSError: the forker did not answer by ``until`` or is gone.
        """
        rights = array.array("i", fds).tobytes()
        # From here on the answer may be running (a forker that does not answer may have
        # been stopped by it), unless the forker says no process was made for the first
        # request: then none of the answer ever ran.
        first, self.spawned = not self.spawned, True
        self._asked += 1
        request = f"{mode} {self._asked}".encode()
        while True:  # never blocked by a forker the answer stopped
            try:
                self._socket.sendmsg([request], [(_SOL_SOCKET, _SCM_RIGHTS, rights)])
                break
            except BlockingIOError:
                self._until(until, write=True)
        while True:  # a late reply to an earlier request names another process: skipped
            self._until(until, write=False)
            try:
                reply = self._socket.recv(64).split()
            except BlockingIOError:
                continue
            if reply == [str(self._asked).encode(), b"-"]:
                self.spawned = not first
                raise OSError("the forker could not make an answer process (fork failed)")
            if len(reply) != 2 or not all(part.isdigit() for part in reply):
                raise OSError("the forker is gone")
            if int(reply[0]) == self._asked:
                pid = int(reply[1])
                _LIVE.add(pid)
                return Child(pid)

    def _until(self, until: float, *, write: bool) -> None:
        left = until - time.monotonic()
        waiting = ([], [self._socket]) if write else ([self._socket], [])
        if left <= 0 or not any(select.select(*waiting, [], left)[:2]):
            raise OSError("the forker did not answer in time")


class Child:
    """One answer process, leading a session of its own: its group holds what it forked."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.code: int | None = None

    def poll(self) -> int | None:
        """Its exit code (``-signal`` when killed), or None while it runs."""
        if self.code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.code = -9  # reaped already: nothing left to wait for
            else:
                if pid:
                    self.code = os.waitstatus_to_exitcode(status)
            if self.code is not None:
                _LIVE.discard(self.pid)
            _reap_orphans()
        return self.code

    def wait(self, timeout: float) -> int | None:
        """:meth:`poll` until it ends or ``timeout`` seconds pass (then None)."""
        end = time.monotonic() + timeout
        pause = 0.0005
        while self.poll() is None:
            left = end - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.02)
        return self.code

    def kill(self) -> None:
        """Kill it and what it forked into its group, and reap it."""
        try:  # noqa: SIM105 (contextlib is a tenth of the harness's start)
            os.killpg(self.pid, 9)
        except OSError:
            pass
        self.wait(5)


_LIVE: set[int] = set()
"""Answer processes not yet waited for: their statuses are :meth:`Child.poll`'s."""


def _reap_orphans() -> None:
    """Reap what the answer forked and left, reparented here, so no zombie holds a slot
    of the uid's process limit; an answer process's own status stays for its poll."""
    while True:
        try:
            found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if found is None or found.si_pid in _LIVE:
            return
        try:
            os.waitpid(found.si_pid, os.WNOHANG)
        except ChildProcessError:
            return


# -- the forker ---------------------------------------------------------------------------


def _serve(sock: Any, libc: Any) -> None:
    """The forker's loop: a process per request, until the harness goes."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the payload and the verdicts' stream are the harness's alone
        os.dup2(null, fd)
    os.close(null)
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    space = ctypes.sizeof(ctypes.c_int) * _FDS
    while True:
        try:
            message, ancillary, _, _ = sock.recvmsg(64, 64 + space)
        except OSError:
            os._exit(0)
        if not message:
            os._exit(0)
        fds: list[int] = []
        for level, kind, data in ancillary:
            if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        mode, _, number = message.decode().partition(" ")
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        try:
            middle = os.fork()
        except OSError:  # out of processes: said as such, and the forker serves on
            middle = -1
        if middle < 0:
            for fd in (ready_r, ready_w, go_r, go_w, *fds):
                os.close(fd)
            try:
                sock.send(number.encode() + b" -")
            except OSError:
                os._exit(0)
            continue
        if middle == 0:
            os.close(ready_r)
            try:
                child = os.fork()
            except BaseException:  # never back into the harness's code: this is a copy
                os._exit(1)  # its pipe closes unwritten: the forker says no process
            if child == 0:
                os.close(ready_w)
                os.close(go_w)
                sock.close()
                # Nothing of the answer runs until its parent is the harness: a middle
                # process it could stop would hang the forker.
                while os.read(go_r, 64):
                    pass
                os.close(go_r)
                _start_answer(mode, fds, libc)  # never returns
            os.write(ready_w, str(child).encode())
            os._exit(0)
        for fd in (ready_w, go_r, *fds):
            os.close(fd)
        pid = os.read(ready_r, 64)
        os.close(ready_r)
        os.waitpid(middle, 0)  # its child is the harness's now
        os.close(go_w)
        try:
            sock.send(number.encode() + b" " + (pid or b"-"))
        except OSError:
            os._exit(0)


def _start_answer(mode: str, fds: Sequence[int], libc: Any) -> None:
    """In the new answer process: a session of its own, its descriptors, then the answer."""
    try:
        os.setsid()
        libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # an ordinary process of its user
        if mode == "main":
            source, stdin, stdout = fds
            os.dup2(stdin, 0)
            os.dup2(stdout, 1)
            os.close(stdin)
            os.close(stdout)
            _end_as_python(lambda: answer_main("main", source))
        else:
            source, requests, replies = fds
            answer_main("call", source, requests, replies)
    except SystemExit:
        if mode == "main":
            raise  # the interpreter's own exit: see _end_as_python
    except BaseException:
        pass
    os._exit(1)


def _end_as_python(run: Callable[[], None]) -> None:
    """Run ``run``, then leave as ``python -c`` leaves: with a ``SystemExit`` that nothing
    here catches, so the interpreter itself waits for threads, runs ``atexit``, flushes
    and closes every stream (``sys.__stdout__``, a wrapper of descriptor 1, an object's
    ``__del__``) and turns the code into the exit status (120 when a final flush fails).
    Ending with ``os._exit`` after flushing ``sys.stdout`` alone lost such output, and a
    right program scored 0."""
    try:
        run()
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc()
        raise SystemExit(1) from None
    raise SystemExit(0)


# -- the answer's side -------------------------------------------------------------------


def answer_main(mode: str, source_fd: int, requests_fd: int = -1, replies: int = -1) -> None:
    """Run in the answer's process: the answer as ``python -c`` would, then serve calls.

    Nothing here is trusted: the answer can replace any of it. It only has to work for an
    answer that does not try.
    """
    chunks = []
    while True:
        chunk = os.read(source_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(source_fd)
    source = b"".join(chunks).decode()
    # The answer runs below the harness's frames and this one, where ``python -c`` runs
    # it at the top: as many more frames, so a recursion the classic recipe allows is.
    depth, frame = 0, sys._getframe()
    while frame.f_back is not None:
        depth, frame = depth + 1, frame.f_back
    _lift_recursion_limit(depth + 1)
    sys.argv = ["-c"]
    sys.path.insert(0, "")
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    namespace = module.__dict__
    # The builtins as they were before the answer ran: which of them it binds (a ``def
    # max`` anywhere, ``globals()["max"] = ...``, ``builtins.max = ...``, a ``del``) is
    # read here, where it runs, and said with every reply (see ``Answer.binds``).
    # Read from the builtins module's own dict, which a module ``__getattr__`` the answer
    # adds cannot answer for; asked with every reply, so kept to two lookups a name.
    held = vars(builtins)
    pristine = dict(held)
    names = [
        (n, value) for n, value in pristine.items() if not (n.startswith("__") and n.endswith("__"))
    ]

    def binds() -> list[str]:
        mine, theirs = namespace.get, held.get
        return [n for n, value in names if mine(n, value) is not value or theirs(n) is not value]

    if mode == "main":
        exec(compile(source, "<string>", "exec", dont_inherit=True), module.__dict__)
        return
    requests = os.fdopen(requests_fd, "rb")

    def send(message: Mapping[str, Any]) -> None:
        view = memoryview(json.dumps(message).encode() + b"\n")
        while view:
            view = view[os.write(replies, view) :]

    try:
        exec(compile(source, "<string>", "exec", dont_inherit=True), module.__dict__)
    except BaseException as exc:
        send({"ready": False, "error": f"{type(exc).__name__}: {exc}"[:_MESSAGE_LIMIT]})
        os._exit(0)
    send({"ready": True, "binds": binds()})
    objects: dict[int, Any] = {}

    def keep(value: Any) -> int:
        objects[id(value)] = value
        return id(value)

    def find(number: int) -> Any:
        return objects[number]

    # Earlier calls' arguments, by the harness's number of the call: an object that kept
    # one (``Queue(data)``), or a generator taking its items from one, changes it in a
    # later call, which the tests see in one program (``_later``).
    kept: dict[Any, tuple[Any, ...]] = {}
    for line in requests:
        printed = None
        called: tuple[Any, list[Any], dict[str, Any], dict[int, Any]] | None = None
        plain: Any = None
        forgot: list[Any] = []
        try:
            request = json.loads(line)
            forgot = _synced(kept, request, find, keep)  # what the tests did to what both keep
            target, method = request["target"], request["method"]
            if type(target) is str and method is not None and target not in namespace:
                raise NameError(f"name {target!r} is not defined")
            if type(target) is int or method is not None:  # an object's, or a name's
                found = find(target) if type(target) is int else namespace[target]
                if method in _PROTOCOLS:  # ``len(obj)``: its class's, as Python calls it
                    function = functools.partial(_PROTOCOLS[method], found)
                else:
                    function = getattr(found, method)
            elif target in namespace:
                function = namespace[target]
            elif request.get("solution") and "Solution" in namespace:
                # SandboxFusion's call tests find a method of ``Solution`` the same way.
                function = getattr(namespace["Solution"](), target)
            else:
                raise NameError(f"name {target!r} is not defined")
            made: list[Any] = []  # one numbering: ``f(a, out=a)`` gets one list
            args = decode(request["args"], find, made=made)
            kwargs = decode(request["kwargs"], find, made=made)
            # Where each of their parts is before the call: what it changes in place is
            # sent back as that place, so the tests change their own (``_changes``).
            called = (request, args, kwargs, places_of(args, kwargs))
            # What the call prints is the tests' to read where they capture it
            # (``redirect_stdout`` around it in one program): recorded here, both streams
            # in the order written, and sent along; elsewhere it goes where it went.
            printed = _Printed(request.get("capture"))
            streams = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = printed.streams(streams)
            try:
                result = function(*args, **kwargs)
            finally:
                sys.stdout, sys.stderr = streams
            plain = plain_value(result)
            # Scalars hold no argument: their places are not looked for. A part of an
            # earlier call's arguments or result is sent as its place there, ``[[seq]]``
            # first: the tests' own (``_kept``), as in one program.
            where: dict[int, list[Any]] = {}
            if isinstance(plain, _HOLDERS):
                for seq, (_, _, before, _) in kept.items():
                    where.update((n, [[seq], *path]) for n, (path, _) in before.items())
                parts = places_of(args, kwargs)
                where.update((number, path) for number, (path, _) in parts.items())
            reply = {"ok": True, "value": encode(plain, keep, places=where)}
        except BaseException as exc:
            reply = {
                "ok": False,
                "error": type(exc).__name__,
                "message": str(exc),
                "kinds": [kind.__name__ for kind in type(exc).__mro__[1:]],
            }
            try:  # as raised, where they are data: the harness rebuilds it from them
                reply["raised"] = encode(plain_value(list(exc.args)), keep)
            except BaseException:
                reply["raised"] = None
            try:  # and its attributes (``e.line``), read from its dict, not computed
                fields = dict(list(vars(exc).items())[:FIELDS])
                reply["fields"] = encode(plain_value(fields), keep)
            except BaseException:
                reply["fields"] = None
        if called is not None:
            after: Any
            try:  # returned or raised: the harness decides what it copies (``Answer.call``)
                after, now = _changes(*called, keep)
                if called[3]:  # it holds parts a later call may change
                    kept[called[0].get("seq")] = (*called[1:], now)
            except BaseException:
                after = "unread"  # left nested past the wire's depth, or in a cycle
            if after is not None:
                reply["after"] = after
            if reply.get("ok") is True and isinstance(plain, _HOLDERS):
                _keep_result(kept, called[0].get("seq"), plain, keep)
        later: Any
        try:  # what this call did to the arguments and results of earlier ones
            later = _later(kept, called[0].get("seq") if called else None, keep)
        except BaseException:
            later = "unread"
        if later:
            reply["later"] = later
        if forgot:
            reply["forgot"] = forgot
        reply["binds"] = binds()
        if printed is not None and (printed.runs or printed.overflow):
            reply["printed"] = printed.log()
            reply["overflow"] = printed.overflow
        send(reply)
    os._exit(0)


# Results that can hold one of the call's arguments.
_HOLDERS = (list, tuple, set, frozenset, dict, bytearray, collections.deque)


def _changes(
    request: "dict[str, Any]",
    args: "list[Any]",
    kwargs: "dict[str, Any]",
    before: "dict[int, tuple[list[Any], Any]]",
    keep: "Callable[[Any], int]",
) -> "tuple[dict[str, Any] | None, str]":
    """What a call did to its arguments: ``None`` where it changed none, else all of
    them as they are now, encoded as the harness sent them (one value for the
    positional ones, one for the keyword ones, so what they share travels), and which
    changed (``changed``: indices as text, and names).

    Every argument is read again, a tuple's lists too (a change inside one went unseen),
    and compared as text, a set's items in order of their own text (``1`` is no
    ``True``, and a set rebuilt here may iterate in another order). A part that was
    there ``before`` the call is sent as its place then (``al``): the harness changes
    its own there, so an inner list the tests hold sees the change, and one the call
    replaced does not, as in one program. And their text now, which later calls'
    changes are read against (:func:`_later`)."""
    now_args, now_kwargs = arguments(args, kwargs, before, keep)
    sent_args, sent_kwargs = request["args"], request["kwargs"]
    changed = [
        str(index)
        for index, (now, sent) in enumerate(zip(now_args, sent_args, strict=True))
        if text(now) != text(sent)
    ]
    named_now, named_sent = dict(_named_items(now_kwargs)), dict(_named_items(sent_kwargs))
    changed += [name for name, now in named_now.items() if text(now) != text(named_sent[name])]
    now = text([now_args, now_kwargs])
    if not changed:
        return None, now
    return {"args": now_args, "kwargs": now_kwargs, "changed": changed}, now


def _synced(
    kept: "dict[Any, tuple[Any, ...]]",
    request: Any,
    find: "Callable[[int], Any]",
    keep: "Callable[[Any], int]",
) -> "list[Any]":
    """Before a call: do to the values both sides keep what the tests did to theirs
    (``sync``: each root's parts as the harness reads them, ``_kept.Shared.changes``),
    in place; their text then is theirs now, so that no later call sends the tests' own
    change back to them (``_later``). Then keep only the values the tests carry on
    (``carried``: not those they no longer hold, whose last change came with them, nor
    those past the bounds, which they decide), and forget those no part of which is held
    here either (its copy of an argument the answer did not keep): each is read again
    after every call. Returns those."""
    for entry in request.get("sync") or ():
        root = kept.get(entry.get("seq"))
        if root is None:
            continue  # past what this side keeps
        args, kwargs, before, _ = root
        parts = {tuple(path): part for path, part in before.values()}
        try:
            refill_parts(parts, entry.get("parts"), find)
            now = text(list(arguments(args, kwargs, before, keep)))
        except BaseException:
            kept.pop(entry.get("seq"), None)  # nothing the harness sends does this
            continue
        kept[entry["seq"]] = (args, kwargs, before, now)
    carried = request.get("carried")
    if type(carried) is list:
        carried = {key for key in carried if type(key) is int}
        for key in [key for key in kept if key not in carried]:
            del kept[key]
    forgot = unheld(kept)
    for key in forgot:
        del kept[key]
    return forgot


def _keep_result(
    kept: "dict[Any, tuple[Any, ...]]", seq: Any, plain: Any, keep: "Callable[[Any], int]"
) -> None:
    """Keep a call's result as the harness does (``-seq``): the tests change their copy,
    as they would the answer's own where it keeps it (``return self._items``)."""
    if type(seq) is not int:
        return
    before = places_of([plain], {})
    if not before:
        return
    try:  # noqa: SIM105 (contextlib is a tenth of the harness's start)
        kept[-seq] = ([plain], {}, before, text(list(arguments([plain], {}, before, keep))))
    except BaseException:
        pass  # nested past the wire: the call failed for it already


def _later(
    kept: "dict[Any, tuple[Any, ...]]", current: Any, keep: "Callable[[Any], int]"
) -> "list[dict[str, Any]]":
    """The arguments of earlier calls (``kept``: args, kwargs, their places then, and
    their text as last sent) that changed since, each as :func:`_changes` sends them,
    with its call's number (``seq``): a generator that sorted its argument as the tests
    took its items, or a ``Queue(data)`` popping from ``data`` later, changed the tests'
    list in one program and here went unseen (a hostile review)."""
    later = []
    for seq, (args, kwargs, before, then) in list(kept.items()):
        if current is not None and seq in (current, -current):
            continue
        now_args, now_kwargs = arguments(args, kwargs, before, keep)
        now = text([now_args, now_kwargs])
        if now != then:
            kept[seq] = (args, kwargs, before, now)
            later.append({"seq": seq, "args": now_args, "kwargs": now_kwargs})
    return later


def _named_items(data: Any) -> "list[Any]":
    """The ``[name, value]`` pairs of keyword arguments encoded as a dict (``{"d": ...}``;
    one met again is ``{"same": n}``, which holds none)."""
    return data["d"] if type(data) is dict and "d" in data else []


_INT_MAX = 2**31 - 1  # the largest recursion limit Python takes


def _lift_recursion_limit(frames: int) -> None:
    """Raise the recursion limit by ``frames``, the harness's below the answer, and keep
    it raised when the answer sets its own: ``setrecursionlimit(1100)`` left it about
    ten frames short of what ``python -c`` allows, and ``getrecursionlimit`` says what
    the answer set."""
    real_set, real_get = sys.setrecursionlimit, sys.getrecursionlimit
    real_set(real_get() + frames)

    def setrecursionlimit(limit: int) -> None:
        if not isinstance(limit, int) or not 1 <= limit <= _INT_MAX:
            real_set(limit)  # Python's own error (``ValueError``, ``OverflowError``)
        # Past the C int, the lift overflowed where the answer's own limit did not.
        real_set(min(limit + frames, _INT_MAX))

    def getrecursionlimit() -> int:
        return real_get() - frames

    sys.setrecursionlimit, sys.getrecursionlimit = setrecursionlimit, getrecursionlimit
