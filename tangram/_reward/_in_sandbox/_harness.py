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

# Every ``compile`` of the program (the answer's, the prompt's, the tests') passes
# ``dont_inherit=True``: else what it compiles inherits this import, and their annotations
# are strings where plain Python evaluates them (a ``def`` whose annotation names nothing
# passed; one that reads its own annotations failed).
from __future__ import annotations

import ast
import builtins
import ctypes
import json
import os
import select
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence

if __name__ != "__main__":  # imported by tangram; in the sandbox the program holds them
    from typing import Any

    from ._calls import (
        Answer,
        Function,
        _answer_ran,
        _Deadline,
        _memfd,
        _Rebound,
        _spawn,
        start_forker,
    )
    from ._checks import call_passed, count_tests, same_output, test_plan
    from ._fork import Child

__all__ = ["main"]

_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3
_OUTPUT_LIMIT = 8 << 20

# -- the harness -----------------------------------------------------------------------------


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


_Plan = tuple[list[tuple[ast.Module, bool]], bool, types.ModuleType]


def _assert_plans(suite: Mapping[str, Any], answer: Answer) -> list[_Plan]:
    """The test steps and a namespace per reading (:func:`_readings`), made before the
    answer runs.

    Once it runs, the answer can lower this process's limits (``prlimit`` needs only the
    same uid): an import that then failed to open its file made a wrong answer's 0 an
    infrastructure failure. So every module the tests name is imported first.
    """
    entry_point = suite.get("entry_point")
    tree, steps, check = test_plan(suite["source"], entry_point)
    if _imports_unittest(tree):
        __import__("unittest")  # and its runs are read (:class:`_UnittestRuns`)
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
        # which under any other name was counted as a test and never ran. A module, which
        # is ``sys.modules["__main__"]`` while they run: ``unittest.main()`` runs the
        # ``TestCase`` classes of that module, and found none in the harness's own (it
        # exited 0 with no test run, a wrong answer's full marks).
        module = types.ModuleType("__main__")
        namespace = vars(module)
        namespace["__builtins__"] = builtins
        exec(compile(helpers, "<prompt>", "exec", dont_inherit=True), namespace)
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
                namespace[name] = answer.exceptions.get(name) or Function(answer, name)
        if entry_point:
            namespace[entry_point] = Function(answer, entry_point, builds=not declared)
        plans.append((list(steps), bool(check), module))
    return plans


class _Ended(Exception):
    """The tests ended the program (``sys.exit``, ``exit()``): ``ok`` for a status of 0."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok


def _run(code: Callable[[], object]) -> bool:
    """Whether one step of the tests ran without raising.

    :raises _Ended: the tests called ``sys.exit``. Only the tests can: the answer's
        exceptions are rebuilt here without ``SystemExit`` (see :func:`._raised.rebuilt`).
    """
    try:
        code()
    except SystemExit as exc:
        raise _Ended(exc.code in (None, 0)) from None
    except Exception:
        return False
    return True


def _imports_unittest(tree: ast.Module) -> bool:
    return any(
        (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "unittest")
        or (
            isinstance(node, ast.Import)
            and any(alias.name.split(".")[0] == "unittest" for alias in node.names)
        )
        for node in ast.walk(tree)
    )


class _UnittestRuns:
    """The ``unittest`` runs of the tests, each step's read when it ends.

    ``unittest.main(exit=False)`` (tests made in notebooks) and a ``TextTestRunner`` print
    their result and go on, and the classic recipe exits 0 after them whatever failed:
    every answer scored full marks. A step in which a run failed fails; one that exits
    (``unittest.main()``) ends the program as its status says (:class:`_Ended`).
    """

    def __init__(self) -> None:
        self._made: list[Any] = []
        module = sys.modules.get("unittest")  # imported before the tests, if they name it
        self._result = getattr(module, "TestResult", None)
        if self._result is None:
            return
        made, init = self._made, self._result.__init__
        self._init = init

        def kept(result: Any, *args: Any, **kwargs: Any) -> None:
            init(result, *args, **kwargs)
            made.append(result)

        self._result.__init__ = kept

    def passed(self) -> bool:
        """Whether every run since the last step passed; forgets them."""
        made = self._made[:]
        self._made.clear()
        return all(result.wasSuccessful() for result in made)

    def close(self) -> None:
        if self._result is not None:
            self._result.__init__ = self._init


def _run_asserts(
    suite: Mapping[str, Any], plan: _Plan, results: list[bool], answer: Answer
) -> None:
    """Whether each test passed, appended to ``results`` in order (``check(entry_point)``
    last) as each ends: a run cut short (:class:`_Rebound`) leaves those that ended.

    Tests that end the program (``check(f); exit(0)``) end here too: as in one program,
    what comes after counts as the status says, all passed for 0, all failed otherwise.

    ``answer.replan`` raises :class:`_Rebound` where the answer bound a builtin the plan
    reads, asked before each result is kept: a call raises it too, but code of the tests
    can catch it (``unittest`` catches everything in a test method), and the test that
    failed for it was kept as failed where the tests, run again, passed. A step cut so
    after one of its calls was answered counts as failed: it was thrown away, and an
    answer that learnt from the step (a failing assert's message calling it again) bound
    a builtin to be asked again, and answered right (a hostile re-review). One cut at its
    first call, as a right answer binding as it starts is, runs again.
    """
    entry_point = suite.get("entry_point")
    steps, check, module = plan
    namespace = vars(module)
    total = sum(is_test for _, is_test in steps) + bool(check and entry_point)
    broken = False
    harness = sys.modules["__main__"]
    sys.modules["__main__"] = module
    runs = _UnittestRuns()
    try:
        for step, is_test in steps:
            if broken and is_test:
                results.append(False)
                continue
            code = compile(step, "<tests>", "exec", dont_inherit=True)
            answered = answer.answered
            try:
                ok = _run(lambda code=code: exec(code, namespace))  # type: ignore[misc]
                ok = runs.passed() and ok
            finally:
                _replan(answer, answered, is_test, results)
            broken = broken or (not ok and not is_test)
            if is_test:
                results.append(ok)
        if check and entry_point:
            answered = answer.answered
            try:
                ok = not broken and _run(lambda: namespace["check"](namespace[entry_point]))
            finally:
                _replan(answer, answered, True, results)
            results.append(ok)
    except _Ended as end:
        results += [end.ok] * (total - len(results))
    finally:
        sys.modules["__main__"] = harness
        runs.close()


def _replan(answer: Answer, answered: int, is_test: bool, results: list[bool]) -> None:
    """:raises _Rebound: as ``answer.replan``, the step counted as failed if it was a test
    and a call was answered since ``answered`` (see :func:`_run_asserts`)."""
    try:
        answer.replan()
    except _Rebound:
        if is_test and answer.answered > answered:
            results.append(False)
        raise


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

    Where a call changed an argument and did not return None, its change is not copied
    back to the tests (``Answer._copy_back``), and the readings run again with every
    change copied, as in one program: a test passes only where it passes both ways.
    Copied, an answer that emptied its argument rewrote the expected side of
    ``f(xs) == sum(xs)``; never copied, one that changed an argument the task says to
    leave alone passed the tests' check that it was unchanged.
    """
    for faithful in (False, True):
        if faithful and not answer.diverged:
            break
        answer.faithful = faithful
        for number, plan in enumerate(plans):
            if number or faithful:
                answer.close()
            results: list[bool] = []
            try:
                _run_asserts(suite, plan, results, answer)
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
    # Sealed first: until then another process of this user could open our stdin.
    sealed = _seal()
    # Before a byte of the payload is read: the forker must hold neither it nor stdout.
    forked = start_forker()  # reported below, once the secret is known
    _keep_stdout_for_verdicts()
    raw = sys.stdin.buffer.read()
    head, _, body = raw.partition(b"\n")
    secret = head.decode("ascii", "replace")
    if sealed is None and not forked:
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
