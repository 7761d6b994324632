"""Build the sandbox test image from this machine's own files, without any registry.

Writes a root file system tar to stdout for ``docker import``: the host's python3 with its
standard library, a POSIX shell, a few coreutils and the shared libraries they link,
plus an unprivileged ``sandbox`` user (uid 65534). CI has no registry access, so the tests
cannot pull ``python:3-slim``; any image with ``python3`` works the same way.

    python3 .ci/sandbox_image.py | docker import - tangram-sandbox-test:latest
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile

TOOLS = [
    "sh",
    "dash",
    "cat",
    "ls",
    "echo",
    "sleep",
    "nproc",
    "id",
    "touch",
    "mkdir",
    "rm",
    "head",
    "tail",
    "dd",
    "yes",
    "env",
    "seq",
    "true",
    "false",
    "wc",
    "grep",
    "taskset",
    "setsid",
]
SKIP = re.compile(r"/(test|tests|idlelib|tkinter|turtledemo|ensurepip|lib2to3|pydoc_data)(/|$)")


def python() -> str:
    # The system interpreter: a pyenv or virtualenv one lives under a private home.
    for candidate in ("/usr/bin/python3", shutil.which("python3") or "", sys.executable):
        if candidate and os.path.exists(candidate):
            return os.path.realpath(candidate)
    raise SystemExit("no python3 found")


def libraries(paths: list[str]) -> set[str]:
    found: set[str] = set()
    for path in paths:
        result = subprocess.run(["ldd", path], capture_output=True, text=True, check=False)
        for line in result.stdout.splitlines():
            match = re.search(r"(/\S+)", line.split("=>")[-1])
            if match and os.path.exists(match.group(1)):
                found.add(match.group(1))
    return found


def main() -> None:
    interpreter = python()
    out = subprocess.run(
        [interpreter, "-c", "import sysconfig;print(sysconfig.get_paths()['stdlib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    stdlib = out.stdout.strip()
    binaries = [interpreter] + [p for t in TOOLS if (p := shutil.which(t, path="/usr/bin:/bin"))]
    modules = []
    files: set[str] = set(binaries)
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = [d for d in dirs if not SKIP.search(os.path.join(root, d))]
        for name in names:
            full = os.path.join(root, name)
            files.add(full)
            if name.endswith(".so"):
                modules.append(full)
    files |= libraries(binaries + modules)
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:

        def directory(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def text(name: str, data: str) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data.encode()))

        def link(name: str, target: str) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)

        added: set[str] = set()
        for name in ("usr", "usr/bin", "usr/lib", "usr/lib64", "etc", "proc", "sys", "dev"):
            directory(name)
            added.add(name)
        for name in ("tmp", "work"):
            directory(name, 0o1777)
        link("bin", "usr/bin")
        link("lib", "usr/lib")
        link("lib64", "usr/lib64")
        text("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nsandbox:x:65534:65534::/work:/bin/sh\n")
        text("etc/group", "root:x:0:\nsandbox:x:65534:\n")
        for path in sorted(files):
            real = os.path.realpath(path)
            name = real.lstrip("/")
            for prefix in ("lib/", "lib64/", "bin/"):
                if name.startswith(prefix):
                    name = "usr/" + name
            parent = os.path.dirname(name)
            parts = parent.split("/")
            for i in range(1, len(parts) + 1):
                sub = "/".join(parts[:i])
                if sub and sub not in added:
                    directory(sub)
                    added.add(sub)
            if name not in added:
                added.add(name)
                tar.add(real, arcname=name, recursive=False)
            # Keep the name it is called by (python3, sh, ld-linux) as a link to the file.
            alias = path.lstrip("/")
            for prefix in ("lib/", "lib64/", "bin/"):
                if alias.startswith(prefix):
                    alias = "usr/" + alias
            if alias != name and alias not in added:
                added.add(alias)
                link(alias, "/" + name)
        for alias in ("usr/bin/python3", "usr/bin/python"):
            if alias not in added:
                link(alias, interpreter)


if __name__ == "__main__":
    main()
