"""The runner: one long-lived process per Docker sandbox that runs actions on request.

It is the container's main process (``python3 -c`` with this file's text, so an image
needs nothing installed but ``python3``) and reads one JSON request per line on its
attached stdin, answering one JSON line on stdout. An action therefore costs a line each
way instead of a ``docker exec`` (an API round trip plus a runc start), while still
running inside the container's cgroup, so the grant applies and CPU is accounted per
action from the cgroup's own counters.

As PID 1 of the container it also reaps orphans and, after each action, kills every other
process in the container: nothing an action starts outlives it.

This module is never imported by the SDK; ``RUNNER_SOURCE`` is its text.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORK = "/work"


def cpu_usage() -> float:
    """CPU seconds the container's cgroup has used (v2 ``cpu.stat``, v1 ``cpuacct``)."""
    try:
        for line in Path("/sys/fs/cgroup/cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec"):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    for path in (
        "/sys/fs/cgroup/cpuacct/cpuacct.usage",
        "/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage",
    ):
        try:
            return int(Path(path).read_text()) / 1e9
        except OSError:
            continue
    return float("nan")


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def others() -> list[int]:
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                state = Path(f"/proc/{name}/stat").read_bytes().rpartition(b")")[2].split()[0]
            except OSError:
                continue
            if state != b"Z":
                found.append(int(name))
    return found


def kill_others() -> int:
    """Kill every process but this one, until none is left; return how many were found."""
    most = 0
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        reap()
        pids = others()
        if not pids:
            break
        most = max(most, len(pids))
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
    reap()
    return most


def run(request: dict[str, Any]) -> dict[str, Any]:
    limit = int(request["output_limit"])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK}
    env.update(request["env"])
    before = cpu_usage()
    try:
        proc = subprocess.Popen(
            request["argv"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=WORK,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        kill_others()
        return {
            "exit_code": 127 if isinstance(exc, FileNotFoundError) else 126,
            "stdout": "",
            "stderr": base64.b64encode(f"{exc}\n".encode()).decode(),
        }
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    data = base64.b64decode(request["stdin"])
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    out = {out_fd: bytearray(), err_fd: bytearray()}
    dropped = dict.fromkeys(out, False)
    sel = selectors.DefaultSelector()
    for pipe in (proc.stdout, proc.stderr):
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe.fileno(), selectors.EVENT_READ)
    if data:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    deadline = time.monotonic() + float(request["timeout"])
    timed_out = False
    exited_at: float | None = None
    first_kill = 0
    sel.register(0, selectors.EVENT_READ)  # a cancel request can come while it runs
    cancelled = False
    while out_fd in sel.get_map() or err_fd in sel.get_map():
        now = time.monotonic()
        if exited_at is None and wants_cancel():
            cancelled = True
            exited_at = now
            first_kill = kill_others()
        if exited_at is None and proc.poll() is not None:
            # The command is done: leftovers holding its pipes go now, so reads end.
            exited_at = now
            first_kill = kill_others()
        if now >= deadline and exited_at is None:
            timed_out = True
            exited_at = now
            first_kill = kill_others()
        if exited_at is not None and now - exited_at > 2.0:
            break
        for key, _ in sel.select(timeout=0.05):
            fd = key.fd
            if fd == 0:
                if not read_stdin():
                    sel.unregister(0)
                    STOP.append(True)  # the host hung up: stop the command, then exit
                continue
            if fd == in_fd:
                try:
                    written = os.write(fd, data[:65536])
                    data = data[written:]
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(fd)
                    proc.stdin.close()
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                continue
            room = limit - len(out[fd])
            if room > 0:
                out[fd] += chunk[:room]
            if len(chunk) > room:
                dropped[fd] = True
    if exited_at is None:
        # Both pipes closed first: the command may still be working (or just exiting).
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    sel.close()
    leftovers = kill_others() + first_kill
    status = proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    if not proc.stdin.closed:
        proc.stdin.close()
    stdout, stderr = bytes(out[out_fd]), bytes(out[err_fd])
    return {
        "exit_code": None if timed_out or cancelled or status < 0 else status,
        "cancelled": cancelled,
        "signal": -status if status < 0 else None,
        "timed_out": timed_out,
        "stdout": base64.b64encode(stdout).decode(),
        "stderr": base64.b64encode(stderr).decode(),
        "stdout_truncated": dropped[out_fd],
        "stderr_truncated": dropped[err_fd],
        "cpu_seconds": cpu_usage() - before,
        "leftovers": leftovers,
    }


def inside(path: str) -> Path:
    target = Path(WORK, path).resolve()
    if not str(target).startswith(WORK + "/"):
        raise PermissionError(f"{path!r} leads outside the work dir")
    return target


def handle(request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    if op == "run":
        return run(request)
    if op == "put":
        target = inside(request["path"])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(request["data"]))
        return {}
    if op == "get":
        return {"data": base64.b64encode(inside(request["path"]).read_bytes()).decode()}
    if op == "ping":
        return {"pid": os.getpid()}
    raise ValueError(f"unknown op {op!r}")


BUFFER = bytearray()
STOP: list[bool] = []


def read_stdin() -> bool:
    """Read what the host sent so far into ``BUFFER``; False once the host hung up."""
    chunk = os.read(0, 65536)
    BUFFER.extend(chunk)
    return bool(chunk)


def next_request() -> dict[str, Any] | None:
    while b"\n" not in BUFFER:
        if STOP or not read_stdin():
            return None
    line, _, rest = bytes(BUFFER).partition(b"\n")
    BUFFER[:] = rest
    request: dict[str, Any] = json.loads(line)
    return request


def wants_cancel() -> bool:
    """Whether a cancel request (or a hang-up) arrived while an action runs."""
    if STOP:
        return True
    lines = bytes(BUFFER).split(b"\n")
    for line in lines[:-1]:
        if json.loads(line).get("op") == "cancel":
            # Everything up to and including the cancel is consumed; the host sends
            # nothing else while an action runs.
            BUFFER.clear()
            return True
    return False


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    stdout = sys.stdout.buffer
    stdout.write(b'{"ready": true}\n')
    stdout.flush()
    while (request := next_request()) is not None:
        if request.get("op") == "cancel":
            continue  # it came after its action had finished: nothing to stop
        try:
            reply = handle(request)
            reply["ok"] = True
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        reply["id"] = request.get("id")
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main()


RUNNER_SOURCE = Path(__file__).read_text()
