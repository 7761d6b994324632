"""A trainer's interpreter that sandbox uids cannot reach, lent read-only (``_lend``).

The setting of issue #18: a root trainer keeps its environment under a directory no
other user may enter (a 0700 ``/root``), and each sandbox runs as a uid of its own. Here
a virtualenv with a package of its own sits in a 0700 directory beside a secret file;
the sandbox must run the venv's interpreter with its package, and see nothing else of
that directory, nor be able to change the venv. Real bubblewrap, real uids: root only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from _venvs import make_venv

import tangram
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._local._lend import open_lend
from tangram._sandbox._pool import Sandbox, SandboxPool
from tangram.errors import SandboxBrokenError

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        os.geteuid() != 0 and not os.environ.get("CI"), reason="a uid per sandbox needs root"
    ),
]


@contextlib.asynccontextmanager
async def _sandbox(backend: LocalBackend) -> AsyncIterator[Sandbox]:
    """One sandbox of a pool on ``backend``, with a runtime lending its cores."""
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        yield sbx


@pytest.fixture
def hidden_env() -> Iterator[Path]:
    """``<top>/env``: a venv (``tests/_venvs.py``) whose ``<top>`` is 0700, beside
    ``<top>/secret.txt``."""
    top = Path(tempfile.mkdtemp(prefix="trainer-home-", dir="/tmp"))  # 0700, as /root
    make_venv(top / "env")
    (top / "secret.txt").write_text("the trainer's\n")
    yield top
    shutil.rmtree(top)


async def test_an_environment_no_sandbox_uid_can_reach_is_lent_read_only(
    hidden_env: Path,
) -> None:
    python = str(hidden_env / "env" / "bin" / "python")
    backend = LocalBackend(python=python)
    async with _sandbox(backend) as sbx:
        ran = await sbx.run(code="import sys, trainer_only; print(sys.prefix, trainer_only.VALUE)")
        looked = await sbx.run(code=f"import os; print(os.listdir({str(hidden_env)!r}))")
        stole = await sbx.run(code=f"print(open({str(hidden_env / 'secret.txt')!r}).read())")
        wrote = await sbx.run(code=f"open({str(hidden_env / 'env' / 'x')!r}, 'w')")
    assert "lent read-only" in backend.protections.namespaces
    assert ran.ok, ran
    assert ran.stdout.decode().split() == [str(hidden_env / "env"), "42"]
    assert looked.stdout.decode().strip() == "['env']"  # the rest of the home: not there
    assert not stole.ok and b"No such file" in stole.stderr
    assert not wrote.ok and b"Read-only" in wrote.stderr
    assert not (hidden_env / "env" / "x").exists()


def _mounts(under: Path) -> list[str]:
    """The host's mounts at or under ``under`` (other tests' sandboxes mount work dirs)."""
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line for line in lines if f" {under}" in line]


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_lending_leaves_the_hosts_mounts_as_they_were(hidden_env: Path) -> None:
    """The tmpfs and the binds live in each command's own mount namespace."""
    before = _mounts(hidden_env)
    backend = LocalBackend(python=str(hidden_env / "env" / "bin" / "python"))
    async with _sandbox(backend) as sbx:
        assert (await sbx.run(code="print(1)")).ok
    assert _mounts(hidden_env) == before == []
    assert _names(hidden_env) == ["env", "secret.txt"]


def test_nothing_is_lent_where_nothing_blocks_the_way(tmp_path: Path) -> None:
    assert open_lend(shutil.which("python3", path="/usr/bin:/bin") or "") is None
    if os.access(sys.executable, os.X_OK) and all(os.stat(p).st_mode & 0o001 for p in ("/tmp",)):
        reachable = Path(tempfile.mkdtemp(dir="/tmp"))
        reachable.chmod(0o755)
        try:
            (reachable / "python").symlink_to("/usr/bin/python3")
            assert open_lend(str(reachable / "python")) is None
        finally:
            shutil.rmtree(reachable)


async def test_this_processs_own_interpreter_is_lent_when_out_of_reach() -> None:
    """The default: this process's interpreter where sandboxes can run it, lent where
    only a directory above it is out of their reach; the system's only where neither."""
    backend = LocalBackend()
    async with _sandbox(backend) as sbx:
        result = await sbx.run(code="import sys; print(sys.executable)")
    assert result.ok, result
    assert result.stdout.decode().strip() == backend.python
    if backend._lend is not None:
        assert backend.python == sys.executable


async def test_an_interpreters_neighbours_are_not_lent(hidden_env: Path) -> None:
    """Attack from a review: ``python`` named as a link in a directory beside other files
    (``~/.local/bin/python3.x``, a ``/root/bin``); lending its directory showed the
    sandbox a deploy token next to it. The path itself is lent, as a file, alone."""
    (hidden_env / "bin").mkdir(mode=0o755)
    (hidden_env / "bin" / "python3").symlink_to("/usr/bin/python3")
    token = hidden_env / "bin" / "deploy-token.sh"
    token.write_text("export HF_TOKEN=hf_secret\n")
    token.chmod(0o755)
    backend = LocalBackend(python=str(hidden_env / "bin" / "python3"))
    async with _sandbox(backend) as sbx:
        ran = await sbx.run(code="print('ran')")
        stole = await sbx.run(code=f"print(open({str(token)!r}).read())")
        looked = await sbx.run(code=f"import os; print(os.listdir({str(hidden_env / 'bin')!r}))")
    assert ran.stdout == b"ran\n", ran
    assert not stole.ok and b"hf_secret" not in stole.stdout
    assert looked.stdout.decode().strip() == "['python3']"


async def test_a_lend_that_fails_at_a_call_is_the_sandboxs_failure(hidden_env: Path) -> None:
    """The environment gone after the pool started (moved, unmounted): the call raises
    SandboxBrokenError, which the adapters keep from the model, not a bare
    SubprocessError nor a result the model would read as its code's."""
    backend = LocalBackend(python=str(hidden_env / "env" / "bin" / "python"))
    async with _sandbox(backend) as sbx:
        assert (await sbx.run(code="print(1)")).ok
        (hidden_env / "env").rename(hidden_env / "moved")
        with pytest.raises(SandboxBrokenError, match="could not start"):
            await sbx.run(code="print(1)")
        (hidden_env / "moved").rename(hidden_env / "env")
