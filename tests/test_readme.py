"""The README's example runs as written and prints what the README says it prints.

The example is the first thing a user copies, so it is run the way they would run it: as a
script in a fresh interpreter (``sys.executable``, the one running the tests, with tangram
installed). The expected output is the first ``text`` block after the code.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _block(text: str, language: str, start: int = 0) -> tuple[str, int]:
    """The first fenced block in ``language`` at or after ``start``, and where it ends."""
    match = re.compile(rf"^```{language}\n(.*?)^```$", re.MULTILINE | re.DOTALL).search(text, start)
    assert match is not None, f"no ```{language} block after offset {start}"
    return match.group(1), match.end()


def test_readme_example_runs_and_prints_what_it_says(tmp_path: Path) -> None:
    text = README.read_text(encoding="utf-8")
    code, end = _block(text, "python")
    expected, _ = _block(text, "text", end)
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected


def test_quickstart_shows_the_same_example() -> None:
    # docs/quickstart.md walks through the README's example step by step; keep them one.
    readme = README.read_text(encoding="utf-8")
    quickstart = (README.parent / "docs" / "quickstart.md").read_text(encoding="utf-8")
    code, end = _block(readme, "python")
    shown, shown_end = _block(quickstart, "python")
    assert shown == code
    assert _block(quickstart, "text", shown_end)[0] == _block(readme, "text", end)[0]
