"""The SandboxFusion server (``tangram serve-sandbox-fusion``) against hostile requests.

The code and every field of a request come from a policy rewarded for any hole. What they
control must come back as the request's error (4xx) or the run's own result, never as a
tangram infrastructure failure (503 ``SandboxError``, logged at ERROR and counted: a stop
the model could trigger at will), and never as a verdict on code that did not run (exit
126). One request's cost to the trainer is bounded: its body, the files it writes and
fetches, its timeout, how long a silent connection holds a thread.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anyio
import anyio.to_thread
import httpx
import pytest

import tangram
from tangram import _fusion
from tangram._frameworks import _failures, _session
from tangram._fusion import _http, _server
from tangram._reward._grade import grade
from tangram._sandbox._local import _backend as local
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import SandboxPool
from tangram.errors import InvalidSettingError, SandboxBrokenError

B64 = base64.b64encode(b"x").decode()
CONFIG = """mode = "local"
[sandbox]
backend = "local"
warm = 0
timeout = 30
{extra}
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def extra_config() -> str:
    return ""


@pytest.fixture
async def server(monkeypatch: pytest.MonkeyPatch, extra_config: str) -> AsyncIterator[str]:
    """tangram's run_code server on a free loopback port, over a local-mode config."""
    folder = Path(tempfile.mkdtemp(prefix="fusion-hostile-"))
    (folder / "tangram.toml").write_text(CONFIG.format(extra=extra_config))
    monkeypatch.setenv("TANGRAM_CONFIG", str(folder / "tangram.toml"))
    _failures.reset()
    async with _fusion.serve(port=0) as url:
        yield f"{url}/run_code"
    await _session.aclose()


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(url, json=body)


def _not_ours(response: httpx.Response, label: str) -> str | None:
    """A line if the answer was a tangram failure (503, or counted); None if not."""
    counts = _failures.counts()
    _failures.reset()
    if response.status_code == 503 or counts:
        return f"{label}: HTTP {response.status_code} {response.text[:160]!r} counts={counts}"
    return None


def _exchange(url: str, raw: bytes, *, timeout: float = 10) -> bytes:
    """Send ``raw`` on a fresh connection, half-close it, and read the whole answer."""
    parsed = urlparse(url)
    assert parsed.hostname is not None and parsed.port is not None
    with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError) as exc:
            chunks.append(f"<{type(exc).__name__}>".encode())
        return b"".join(chunks)


def _head(length: str, extra: str = "") -> bytes:
    return (
        "POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {length}\r\n\r\n"
    ).encode()


# -- 1. what the code and the request control is never tangram's failure ------------------

# Each makes the fetched name something a get refuses; all made by the code itself.
FETCH_CASES = {
    "symlink-to-host-file": "import os; os.symlink('/etc/passwd', 'out.txt')",
    "symlink-dangling": "import os; os.symlink('/nonexistent', 'out.txt')",
    "symlink-to-self": "import os; os.symlink('out.txt', 'out.txt')",
    "fifo": "import os; os.mkfifo('out.txt')",
    "directory": "import os; os.mkdir('out.txt')",
    "unreadable": "import os; open('out.txt', 'w').write('x'); os.chmod('out.txt', 0)",
    "parent-is-file": "open('sub', 'w').write('x')",
    "parent-is-symlink": "import os; os.symlink('/etc', 'sub')",
    "parent-is-fifo": "import os; os.mkfifo('sub')",
    "oversize (> max_file)": "open('out.txt', 'wb').truncate(4 << 20)",
}


@pytest.mark.parametrize("extra_config", ['max_file = "1MiB"'])
@pytest.mark.anyio
async def test_a_fetch_the_code_made_unreadable_is_skipped_not_a_failure(server: str) -> None:
    failures = []
    for label, code in FETCH_CASES.items():
        path = "sub/out.txt" if label.startswith("parent") else "out.txt"
        body = {"code": code, "language": "python", "fetch_files": [path, "ok.txt"]}
        body["code"] += "\nopen('ok.txt', 'w').write('fine')"
        response = await _post(server, body)
        failures.append(_not_ours(response, f"fetch {label}"))
        if response.status_code != 200:
            failures.append(f"fetch {label}: HTTP {response.status_code} {response.text[:160]}")
            continue
        answer = response.json()
        # The readable file still comes back; the other is named in the message only
        # when it exists (root may read a mode-0 file: then it comes back too).
        assert answer["files"]["ok.txt"] == base64.b64encode(b"fine").decode(), label
        assert answer["status"] == "Success", (label, answer)
        if path not in answer["files"]:
            assert path in answer["message"], (label, answer["message"])
    assert not [f for f in failures if f], "\n".join(f for f in failures if f)


@pytest.mark.anyio
async def test_a_missing_fetch_is_skipped_without_a_word(server: str) -> None:
    body = {"code": "print(1)", "language": "python", "fetch_files": ["nope", "a/b/c"]}
    answer = (await _post(server, body)).json()
    assert (answer["status"], answer["files"], answer["message"]) == ("Success", {}, "")


@pytest.mark.parametrize(
    "files",
    [
        {"a": B64, "a/b": B64},
        {"a/b": B64, "a": B64},
        {"a": B64, "./a//b/": B64},
        {"a/b/c": B64, "a/b": B64},
        {"x/y": B64, "x/y/z/w": B64},
    ],
)
@pytest.mark.anyio
async def test_request_files_that_clash_are_refused_422(server: str, files: dict[str, str]) -> None:
    response = await _post(server, {"code": "print(1)", "language": "python", "files": files})
    assert response.status_code == 422, response.text
    assert _not_ours(response, "clash") is None


@pytest.mark.parametrize("extra_config", ['disk = "4MiB"'])
@pytest.mark.anyio
async def test_files_or_code_over_the_disk_are_refused_422(server: str) -> None:
    big = base64.b64encode(b"\0" * (6 << 20)).decode()
    halves = {"a.bin": base64.b64encode(b"\0" * (3 << 20)).decode(), "b.bin": big[: 4 << 20]}
    for files in ({"in.bin": big}, halves):
        response = await _post(server, {"code": "print(1)", "language": "python", "files": files})
        assert response.status_code == 422, response.text[:200]
        assert _not_ours(response, "disk") is None
    code = "print(1)\n" + "#" * (6 << 20)
    response = await _post(server, {"code": code, "language": "python"})
    assert response.status_code == 422, response.text[:200]
    assert _not_ours(response, "disk") is None
    # The sandbox after a refusal was let go: the next request runs.
    answer = (await _post(server, {"code": "print(2)", "language": "python"})).json()
    assert answer["run_result"]["stdout"] == "2\n"


@pytest.mark.anyio
async def test_a_run_timeout_over_the_maximum_is_refused_422(server: str) -> None:
    failures = []
    for timeout in (_server.MAX_RUN_TIMEOUT + 1, 5e18, 1e19, 1e100, 1e308, 10**400):
        raw = json.dumps({"code": "print(1)", "language": "python", "run_timeout": timeout})
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.post(server, content=raw)
        failures.append(_not_ours(response, f"run_timeout={timeout!r:.20}"))
        if response.status_code != 422:
            failures.append(f"run_timeout={timeout!r:.20}: HTTP {response.status_code}")
    body = {"code": "print(1)", "language": "python", "run_timeout": _server.MAX_RUN_TIMEOUT}
    answer = (await _post(server, body)).json()
    assert answer["run_result"]["stdout"] == "1\n"
    assert not [f for f in failures if f], "\n".join(f for f in failures if f)


@pytest.mark.anyio
@pytest.mark.parametrize("seconds", [5e18, 1e19, 1e100, 1e308])
async def test_the_local_backend_clamps_the_cpu_limit_of_any_finite_timeout(
    seconds: float,
) -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        result = await sbx.run(code="print(1)", timeout=seconds)
        assert (result.exit_code, result.stdout) == (0, b"1\n")


BASE = {"code": "print(1)", "language": "python"}
NAN, INF = float("nan"), float("inf")
VARIANTS: dict[str, list[Any]] = {
    "code": [None, 1, 1.5, True, [], {}, ["print(1)"], "a\0b", "\ud800", "\udc80"],
    "language": [None, 1, True, [], {}, "", "PYTHON", "python ", "cpp", "python\0"],
    "stdin": [1, True, [], {}, ["x"], "\ud800"],
    "run_timeout": ["10", True, False, None, -1, 0, -0.0, NAN, INF, -INF, [], {}, [1]],
    "files": [
        "str",
        1,
        True,
        [1],
        {"a": 1},
        {"a": "not base64!"},
        {"a": ["x"]},
        {"": B64},
        {"/abs": B64},
        {"..": B64},
        {"a/../../b": B64},
        {".": B64},
        {"a\0b": B64},
        {"\ud800": B64},
        {"a": True},
        {"x" * 300: B64},
    ],
    "fetch_files": [
        "str",
        1,
        True,
        [1],
        [None],
        {"a": 1},
        ["\0"],
        ["\ud800"],
        [".."],
        ["/"],
        ["."],
        ["/etc/passwd"],
        ["../../etc/passwd"],
        [""],
        [["a"]],
    ],
}
# A falsy value stands for SandboxFusion's default: a run, not a refusal.
DEFAULTS = (None, [], {}, False, 0, "")


@pytest.mark.anyio
async def test_wrong_field_values_are_refused_never_a_failure(server: str) -> None:
    bad = []
    async with httpx.AsyncClient(timeout=60) as client:
        for field, values in VARIANTS.items():
            for value in values:
                raw = json.dumps({**BASE, field: value}).encode()
                try:
                    response = await client.post(server, content=raw)
                except httpx.HTTPError as exc:
                    bad.append(f"{field}={value!r:.40}: {type(exc).__name__}")
                    continue
                status = response.status_code
                ok = 400 <= status < 500 or status == 501
                if status == 200 and value in DEFAULTS and field in ("files", "fetch_files"):
                    ok = True
                if not ok or _not_ours(response, field):
                    bad.append(f"{field}={value!r:.40}: HTTP {status} {response.text[:120]!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.anyio
async def test_a_quoted_value_in_a_refusal_is_bounded(server: str) -> None:
    for body in (
        {**BASE, "run_timeout": "x" * 1_000_000},
        {**BASE, "language": "y" * 1_000_000},
        {**BASE, "run_timeout": json.loads("[" * 500 + "]" * 500)},
    ):
        response = await _post(server, body)
        assert response.status_code in (422, 501) and len(response.content) < 2000, response.text
        assert _not_ours(response, "quoted") is None


# -- 2. fetch_files cannot multiply the answer --------------------------------------------

MAX_FILE = 1 << 20
ALIASES = ["big", "./big", ".//big", "big/", "big/.", "././big"] + [
    "./" * i + "big" for i in range(3, 64)
]


@pytest.mark.parametrize("extra_config", [f"max_file = {MAX_FILE}"])
@pytest.mark.anyio
async def test_one_file_under_many_spellings_is_fetched_once(server: str) -> None:
    code = f"open('big', 'wb').truncate({MAX_FILE})"
    body = {"code": code, "language": "python", "fetch_files": ALIASES}
    answer = (await _post(server, body)).json()
    files = answer["files"]
    assert list(files) == ["big"]  # under the first name it was asked by
    assert len(base64.b64decode(files["big"])) == MAX_FILE
    assert "the same file as 'big'" in answer["message"]


@pytest.mark.anyio
async def test_fetching_stops_at_the_request_cap(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_server, "MAX_FETCH_BYTES", 1500)
    code = "for n in 'abcd': open(n, 'wb').write(b'x' * 1000)"
    body = {"code": code, "language": "python", "fetch_files": ["a", "b", "c", "d"]}
    answer = (await _post(server, body)).json()
    assert list(answer["files"]) == ["a"]
    for name in "bcd":
        assert f"'{name}' (over the 1500 bytes" in answer["message"]
    assert _failures.counts() == {}


@pytest.mark.anyio
async def test_too_many_entries_are_refused_422(server: str) -> None:
    many_fetch = [f"f{i}" for i in range(_server.MAX_FETCH_FILES + 1)]
    many_files = {f"f{i}": "" for i in range(_server.MAX_FILES + 1)}
    for body in ({**BASE, "fetch_files": many_fetch}, {**BASE, "files": many_files}):
        response = await _post(server, body)
        assert response.status_code == 422, response.text[:200]
    at_cap = {**BASE, "fetch_files": many_fetch[:-1], "files": {"f0": B64}}
    answer = (await _post(server, at_cap)).json()
    assert answer["files"] == {"f0": B64}


# -- 3. a program that never ran is not the code's verdict --------------------------------

PAD = "# " + "x" * 200 + "\n"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "language,tail", [("python", "print(input()[::-1])\n"), ("bash", "read x; echo ok $x\n")]
)
@pytest.mark.parametrize("size", [140_000, 2_000_000])
async def test_long_valid_code_runs(server: str, language: str, tail: str, size: int) -> None:
    code = PAD * (size // len(PAD)) + tail
    response = await _post(server, {"code": code, "language": language, "stdin": "abc\n"})
    answer = response.json()
    expected = "cba\n" if language == "python" else "ok abc\n"
    assert answer["run_result"]["stdout"] == expected, str(answer)[:300]
    assert answer["status"] == "Success"


@pytest.mark.anyio
async def test_the_codes_file_is_beside_the_requests_files(server: str) -> None:
    body = {
        "code": "import os, sys; print(open('in.txt').read(), os.path.basename(sys.argv[0]))",
        "language": "python",
        "files": {"in.txt": base64.b64encode(b"given").decode()},
    }
    answer = (await _post(server, body)).json()
    given, name = answer["run_result"]["stdout"].split()
    assert given == "given" and name.startswith(".tangram-run-") and name.endswith(".py")


def test_the_codes_name_never_collides_with_a_requests_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names: Iterator[str] = iter(["aa", "bb", "cc"])
    monkeypatch.setattr(_server.secrets, "token_hex", lambda n: next(names))
    files = {".tangram-run-aa.sh/x": b"", ".tangram-run-bb.sh": b""}
    assert _server._script_name("bash", files) == ".tangram-run-cc.sh"


@pytest.mark.anyio
async def test_an_argument_too_long_for_execve_is_refused_at_the_call() -> None:
    limit = 32 * 4096  # MAX_ARG_STRLEN, its NUL included
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        head = "print(1)\n#"
        fits = head + "x" * (limit - 1 - len(head))
        result = await sbx.run(code=fits)
        assert (result.exit_code, result.stdout) == (0, b"1\n")
        for call in (
            lambda: sbx.run(code=fits + "x"),
            lambda: sbx.run(code="#" + "é" * (limit // 2)),
            lambda: sbx.run(["echo", "x" * limit]),
            lambda: sbx.run("echo " + "x" * limit),
            lambda: sbx.run(["true"], env={"X": "x" * limit}),
        ):
            with pytest.raises(InvalidSettingError, match="over the"):
                await call()
        assert (await sbx.run(["true"])).ok  # the sandbox is not broken by a refusal


@pytest.mark.anyio
async def test_a_long_answer_is_still_graded() -> None:
    answer = "#" + "x" * 200_000 + "\ndef add(a, b):\n    return a + b\n"
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        verdict = await grade(sbx, answer, "assert add(2, 3) == 5\nassert add(1, 1) == 2\n")
    assert (verdict.passed, verdict.total) == (2, 2)


def _failing_spawn(monkeypatch: pytest.MonkeyPatch, exc: OSError) -> None:
    """The host's failure where the backend starts a command (the fork server's answer,
    which reads as ``subprocess``'s would)."""

    def spawn(*args: Any, **kwargs: Any) -> Any:
        raise exc

    monkeypatch.setattr(local, "spawn", spawn)


@pytest.mark.anyio
@pytest.mark.parametrize("code", [errno.EAGAIN, errno.ENOMEM, errno.EMFILE])
async def test_a_host_spawn_failure_is_a_503_not_the_codes_verdict(
    server: str, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    _failing_spawn(monkeypatch, OSError(code, "fork failed (injected)"))
    response = await _post(server, BASE)
    assert response.status_code == 503, response.text[:300]
    assert response.json()["status"] == "SandboxError"
    assert _failures.counts() == {"sandbox_fusion": 1}


@pytest.mark.anyio
async def test_spawn_errors_are_told_apart_in_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        async with pool.sandbox("t") as sbx:
            assert (await sbx.run(["/no/such/program"])).exit_code == 127
        for exc in (
            OSError(errno.EAGAIN, "fork failed"),
            OSError(errno.ENOMEM, "no memory"),
            FileNotFoundError(errno.ENOENT, "no work dir", "/some/work/dir"),
        ):
            with monkeypatch.context() as patch:
                _failing_spawn(patch, exc)
                async with pool.sandbox("t") as sbx:
                    with pytest.raises(SandboxBrokenError, match="could not start"):
                        await sbx.run(["true"])
        with monkeypatch.context() as patch:
            _failing_spawn(patch, OSError(errno.E2BIG, "Argument list too long", "/bin/sh"))
            async with pool.sandbox("t") as sbx:
                assert (await sbx.run(["true"])).exit_code == 126


@pytest.mark.parametrize(
    "exc,program,direct,commands",
    [
        (FileNotFoundError(errno.ENOENT, "x", "/bin/x"), "/bin/x", True, True),
        (PermissionError(errno.EACCES, "x", "./a.out"), "./a.out", True, True),
        (OSError(errno.ENOEXEC, "x", "./a.out"), "./a.out", True, True),
        (OSError(errno.ETXTBSY, "x", "./a.out"), "./a.out", True, True),
        (OSError(errno.ELOOP, "x", "./a.out"), "./a.out", True, True),
        (OSError(errno.E2BIG, "x", "/usr/bin/bwrap"), "/usr/bin/bwrap", False, True),
        # the work dir (chdir) or an unnamed step of the child's set-up: the host's
        (FileNotFoundError(errno.ENOENT, "x", "/work"), "/bin/x", True, False),
        (OSError(errno.EBADF, "x"), "/bin/x", True, False),
        # fork and the host's limits
        (OSError(errno.EAGAIN, "x"), "/bin/x", True, False),
        (OSError(errno.ENOMEM, "x", "/bin/x"), "/bin/x", True, False),
        (OSError(errno.ENFILE, "x", "/bin/x"), "/bin/x", True, False),
        # under bubblewrap, the program spawned is bubblewrap: ours
        (FileNotFoundError(errno.ENOENT, "x", "/usr/bin/bwrap"), "/usr/bin/bwrap", False, False),
    ],
)
def test_which_spawn_errors_are_the_commands(
    exc: OSError, program: str, direct: bool, commands: bool
) -> None:
    assert local._commands_own(exc, program, direct=direct) is commands


# -- 4. malformed HTTP gets an answer -----------------------------------------------------

OK = json.dumps(BASE).encode()
NESTED = b"[" * 100_000 + b"]" * 100_000
NESTED_IN = b'{"code": "print(1)", "language": "python", "files": '
NESTED_IN += b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}"

MALFORMED = {
    "non-numeric Content-Length": (_head("abc") + OK, b" 400"),
    "Content-Length 1e3": (_head("1e3") + OK, b" 400"),
    "Content-Length -1": (_head("-1") + OK, b" 400"),
    "Content-Length +5": (_head("+5") + OK, b" 400"),
    "Content-Length 0x10": (_head("0x10") + OK, b" 400"),
    "Content-Length empty": (_head("") + OK, b" 400"),
    "two Content-Lengths": (_head("3", f"Content-Length: {len(OK)}\r\n") + OK, b" 400"),
    "Content-Length of 5000 digits": (_head("9" * 5000) + OK, b" 413"),
    "Content-Length over MAX_BODY": (_head(str(_server.MAX_BODY + 1)) + OK, b" 413"),
    "chunked": (_head("0", "Transfer-Encoding: chunked\r\n") + b"5\r\nhello\r\n0\r\n\r\n", b" 411"),
    "deeply nested JSON": (_head(str(len(NESTED))) + NESTED, b" 422"),
    "deeply nested JSON in files": (_head(str(len(NESTED_IN))) + NESTED_IN, b" 422"),
    "invalid UTF-8": (_head("4") + b"\xff\xfe\xfd\xfc", b" 422"),
    "not JSON": (_head("3") + b"{{{", b" 422"),
    "JSON number out of range": (_head("5000") + b"1" * 5000, b" 422"),
    "body cut short": (_head("1000") + OK, b"<closed>"),
}


@pytest.mark.anyio
async def test_malformed_requests_get_an_answer(server: str) -> None:
    failures = []
    for label, (raw, expected) in MALFORMED.items():
        reply = await anyio.to_thread.run_sync(lambda raw=raw: _exchange(server, raw))
        status = reply.split(b"\r\n", 1)[0]
        if expected == b"<closed>":  # nothing to answer: the client hung up mid-body
            ok = reply == b""
        else:
            ok = status.startswith(b"HTTP/1.1") and status[8:12] == expected
        if not ok:
            failures.append(f"{label}: got {reply[:120]!r}")
    assert _failures.counts() == {}
    response = await _post(server, BASE)
    assert response.status_code == 200, response.text
    assert not failures, "\n".join(failures)


@pytest.mark.anyio
async def test_an_oversized_body_is_refused_before_it_is_read(server: str) -> None:
    parsed = urlparse(server)
    assert parsed.hostname is not None and parsed.port is not None

    def send() -> bytes:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
            sock.sendall(_head("2147483648") + b'{"code": "')
            return sock.recv(200)

    reply = await anyio.to_thread.run_sync(send)
    assert reply.startswith(b"HTTP/1.1 413"), reply


@pytest.mark.anyio
async def test_keep_alive_still_serves_several_requests(server: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        for n in range(3):
            body = {"code": f"print({n})", "language": "python"}
            assert (await client.post(server, json=body)).json()["run_result"]["stdout"] == (
                f"{n}\n"
            )
        assert (await client.get(server.replace("/run_code", "/v1/ping"))).json() == "pong"


# -- 5. a silent connection does not hold a thread ----------------------------------------


def _handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("Thread-"))


@pytest.mark.anyio
async def test_silent_connections_are_closed(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _server.IDLE_TIMEOUT <= 30
    assert _server._Handler.timeout == _server.IDLE_TIMEOUT
    monkeypatch.setattr(_server._Handler, "timeout", 1.0)  # read at each connection's setup
    parsed = urlparse(server)
    assert parsed.hostname is not None and parsed.port is not None
    before = _handler_threads()
    socks = []
    halves = [
        b"POST /run_code HTTP/1.1\r\nHost: x\r\n",  # half a header
        _head("1000") + b'{"code": ',  # half a body
        b"",  # nothing at all
    ]
    for n in range(30):
        sock = socket.create_connection((parsed.hostname, parsed.port))
        sock.sendall(halves[n % len(halves)])
        socks.append(sock)
    try:
        for _ in range(100):  # a generous bound, 20 s: 1 s each, all at once
            if _handler_threads() <= before:
                break
            await anyio.sleep(0.2)
        assert _handler_threads() <= before, "silent connections still hold their threads"
        for sock in socks:  # each was closed by the server, at most after a 408
            sock.settimeout(5)
            said = b""
            while piece := sock.recv(1 << 16):  # a connection left open times out here
                said += piece
            # The socket's timeout and the server's deadline are both 1 s here: the first
            # closes in silence, the second answers a half-sent header with a 408.
            assert said == b"" or said.startswith(b"HTTP/1.1 408 "), said[:80]
    finally:
        for sock in socks:
            sock.close()
    assert (await _post(server, BASE)).status_code == 200


# -- 6. one request's memory, and every connection's, is bounded --------------------------

# The server in a child process, its peak RSS measured for one request (argv[1] picks it).
PEAK = r"""
import json, os, resource, socket, sys, tempfile
from pathlib import Path
import anyio, anyio.to_thread
from tangram import _fusion
from tangram._frameworks import _session
from tangram._fusion import _server

CASE = sys.argv[1]
cfg = Path(tempfile.mkdtemp()) / "t.toml"
cfg.write_text('mode = "local"\n[sandbox]\nbackend = "local"\nwarm = 0\ntimeout = 30\n')
os.environ["TANGRAM_CONFIG"] = str(cfg)
ITEMS = {"empty-lists": b"[]", "empty-dicts": b"{}", "zeros": b"0", "floats": b"1.5",
         "empty-strings": b'""', "short-strings": b'"ab"'}

def body():
    if CASE == "fetch":
        mib = _server.MAX_FETCH_BYTES >> 20
        code = (f"open('a', 'wb').truncate({mib * 3 // 4} << 20)\n"
                f"open('b', 'wb').truncate({2 * mib} << 20)\n")
        return json.dumps({"code": code, "language": "python", "fetch_files": ["a", "b"]}).encode()
    item, head = ITEMS[CASE], b'{"code":"print(1)","language":"python","x":['
    n = (_server.MAX_BODY - len(head) - 10) // (len(item) + 1) - 1
    return head + (item + b",") * n + item + b"]}"  # no list of n items built here

def post(url, data):
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(data) + data)
        reply = b""
        while chunk := s.recv(1 << 20):
            reply = reply or chunk[:12]
        return reply

async def main():
    data = body()
    async with _fusion.serve(port=0) as url:
        await anyio.to_thread.run_sync(post, url, b'{"code": "print(1)", "language": "python"}')
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        reply = await anyio.to_thread.run_sync(post, url, data)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"delta_mib={(peak - base) >> 10} status={reply[9:12].decode()}")
    await _session.aclose()

anyio.run(main)
"""


def _peak(case: str) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", PEAK, case], capture_output=True, text=True, timeout=120
    )
    found = re.search(r"delta_mib=(\d+) status=(\d+)", out.stdout)
    assert found, out.stdout + out.stderr[-2000:]
    return int(found.group(1)), found.group(2)


@pytest.mark.parametrize(
    ("case", "status"),
    [
        ("empty-lists", "413"),  # 25x its size once parsed: refused unparsed (MAX_BRACKETS)
        ("empty-dicts", "413"),
        ("zeros", "200"),
        ("floats", "200"),
        ("empty-strings", "200"),
        ("short-strings", "200"),  # the worst found: ~18x
    ],
)
def test_one_body_costs_a_bounded_multiple_of_max_body(case: str, status: str) -> None:
    delta, got = _peak(case)
    assert got == status
    assert delta < 24 * (_server.MAX_BODY >> 20), f"{case}: one body -> +{delta} MiB"


def test_one_fetch_costs_at_most_twice_max_fetch_bytes() -> None:
    """A second file up to ``max_file`` (sparse: no disk) was read whole to be skipped."""
    delta, got = _peak("fetch")
    assert got == "200"
    assert delta < 2 * (_server.MAX_FETCH_BYTES >> 20), f"one fetch -> +{delta} MiB"


@pytest.mark.anyio
async def test_a_fetch_over_the_budget_is_skipped_unread(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_server, "MAX_FETCH_BYTES", 4000)  # counted in base64: 3000 raw
    reads: list[str] = []
    get = _server.Sandbox.get

    async def counted(self: Any, path: str) -> bytes:
        reads.append(path)
        return await get(self, path)

    monkeypatch.setattr(_server.Sandbox, "get", counted)
    code = "open('a', 'wb').write(b'x' * 2000); open('b', 'wb').write(b'y' * 2000)\n"
    code += "open('c', 'wb').write(b'z' * 900)"
    body = {"code": code, "language": "python", "fetch_files": ["a", "b", "c", "gone"]}
    answer = (await _post(server, body)).json()
    assert list(answer["files"]) == ["a", "c"]  # a later file that fits is still fetched
    assert "'b' (over the 4000 bytes" in answer["message"]
    assert reads == ["a", "c", "gone"]  # b was never read
    assert _failures.counts() == {}


def _rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10
    return 0


def _address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    assert parsed.hostname is not None and parsed.port is not None
    return parsed.hostname, parsed.port


@pytest.mark.anyio
async def test_a_trickle_does_not_hold_a_thread_past_its_deadline(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle timeout bounds one recv: a header every 0.6 s held the thread forever."""
    monkeypatch.setattr(_server._Handler, "timeout", 1.0)

    def trickle() -> tuple[float, bytes]:
        reply = b""
        with socket.create_connection(_address(server), timeout=5) as sock:
            sock.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\n")
            start = time.monotonic()
            while time.monotonic() - start < 8.0:
                time.sleep(0.6)
                try:
                    sock.sendall(b"X-Slow: y\r\n")
                    sock.setblocking(False)
                    chunk = sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    break
                finally:
                    sock.setblocking(True)
                if not chunk:
                    break
                reply += chunk
            return time.monotonic() - start, reply

    held, reply = await anyio.to_thread.run_sync(trickle)
    assert held < 5.0, f"a trickle held a server thread {held:.1f}s (idle timeout 1 s)"
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert _failures.counts() == {}


@pytest.mark.anyio
async def test_a_slow_body_is_cut_at_the_request_deadline(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_http, "REQUEST_DEADLINE", 1.5)

    def slow() -> bytes:
        with socket.create_connection(_address(server), timeout=10) as sock:
            sock.sendall(_head("1000") + b'{"code": ')
            for _ in range(10):
                time.sleep(0.5)
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")
            sock.settimeout(2)
            with contextlib.suppress(OSError):
                return sock.recv(200)
            return b""

    reply = await anyio.to_thread.run_sync(slow)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert (await _post(server, BASE)).status_code == 200


@pytest.mark.anyio
async def test_connections_are_capped_and_the_rest_wait(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """150 half-sent requests held 151 threads; past the cap they wait unaccepted."""
    monkeypatch.setattr(_server._Handler, "timeout", 2.0)
    before = threading.active_count()
    socks: list[socket.socket] = []

    def open_many() -> None:
        for _ in range(150):
            sock = socket.create_connection(_address(server), timeout=10)
            sock.sendall(b"POST /run_code HTTP/1.1\r\n")
            socks.append(sock)

    try:
        await anyio.to_thread.run_sync(open_many)
        await anyio.sleep(0.5)
        grown = threading.active_count() - before
        # a request past the cap is served once the half-sent ones time out
        with anyio.fail_after(25):
            response = await _post(server, BASE)
    finally:
        for sock in socks:
            sock.close()
    assert grown <= _server.MAX_CONNECTIONS + 2, f"150 half-sent requests hold {grown} threads"
    assert response.status_code == 200
    assert _failures.counts() == {}


@pytest.mark.anyio
async def test_half_sent_bodies_are_bounded_in_memory(server: str) -> None:
    """Each connection parks at most MAX_BODY; a larger declared body is refused unread."""
    size, count = _server.MAX_BODY - (1 << 20), 12
    before = _rss_mib()
    socks: list[socket.socket] = []
    try:

        def fill() -> None:
            for _ in range(count):
                sock = socket.create_connection(_address(server), timeout=30)
                sock.sendall(_head(str(_server.MAX_BODY)) + b" " * size)
                socks.append(sock)

        await anyio.to_thread.run_sync(fill)
        await anyio.sleep(1.0)
        grown = _rss_mib() - before
    finally:
        for sock in socks:
            sock.close()
    bound = 2 * count * _server.MAX_BODY >> 20
    assert grown < bound, f"{count} half-sent bodies grew the RSS by {grown} MiB"
    with socket.create_connection(_address(server), timeout=10) as sock:
        sock.sendall(_head(str(_server.MAX_BODY + 1)))
        assert sock.recv(200).startswith(b"HTTP/1.1 413")
