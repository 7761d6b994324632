"""A virtualenv built by hand for the sandbox tests: a ``pyvenv.cfg`` and a link to the
system's ``python3`` (what a venv is), so no ``venv`` module is needed, with a package of
its own, ``trainer_only`` (``VALUE = 42``), that the system interpreter does not have.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def make_venv(env: Path) -> Path:
    """The venv at ``env`` (created, every part of it 0755); returns its ``bin/python``."""
    system = shutil.which("python3", path="/usr/bin:/bin")
    assert system is not None
    version = subprocess.run(
        [system, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(system)
    (env / "pyvenv.cfg").write_text(f"home = {Path(system).parent}\n")
    packages = env / "lib" / f"python{version}" / "site-packages"
    packages.mkdir(parents=True)
    (packages / "trainer_only.py").write_text("VALUE = 42\n")
    for path in [env, *env.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755)
    return env / "bin" / "python"
