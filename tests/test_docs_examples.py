"""Every code block of README.md and docs/ runs as the page shows it, and prints what it shows.

A reader copies these blocks first, so each runs the way they would run it, on real parts:
the Docker blocks on the real daemon and the image ``.ci/docker.sh`` builds
(``tangram-sandbox-test:latest``), the Ray blocks on a real local Ray (two CPUs), the
simulator and the CLI in full. Only what cannot exist here is left out, and only where the
page marks it.

- Python blocks (```` ```python ````) are found and run by pytest-examples, each as the
  module ``__main__`` in an empty working directory. Where a block shows its output as
  ``#>`` comments under its prints, ``run_print_check`` compares them; where the page shows
  it in a ```` ```text ```` block marked ``output`` (below), the captured stdout must equal
  that block. A block that uses ``tangram.ray`` gets the local Ray, and its ``#>`` lines
  are compared with its stdout (see below why); one that builds a ``DockerBackend`` gets
  the daemon and the test image.
- Command blocks (```` ```sh ````, ``bash``, ``console``, ``shell``) run their lines
  that start with ``tangram `` in page order, in one working directory per page, through
  the CLI's ``main`` in-process; each must exit 0. Their other lines (``make``, ``pip``,
  ``python3 -m verl...``) are set-up and are not run; ```` ```text ```` blocks are output.
  A page's ``export NAME=VALUE`` lines (``$PWD`` the repository) are set before its
  commands and Python blocks run, and ``$NAME`` in its commands is expanded. A server command
  (``tangram serve-sandbox-fusion``) runs in its own process, on a free port, until it
  has answered one real request, and must then stop cleanly on SIGTERM.
- A Python block that defines ``test_*`` functions is a reader's test module: besides
  running as a module, it is run by pytest, and its tests must pass.

Markers: an HTML comment on the line right before a fence, ``<!-- test: NAME -->``,
invisible on GitHub and in the built site. They are defined here and nowhere else:

- ``gpu``: needs a CUDA GPU; runs wherever torch sees one (the device machine).
- ``cluster``: needs a multi-node cluster.
- ``remote-api``: calls a remote service that cannot be reached here.
- ``training``: a framework's full training run.
- ``results``: a command block that reproduces a page's measured results at full size
  (minutes of CPU); the cheap examples on the same page run.
- ``continues``: a Python block that builds on the page's previous Python block: it runs
  with the names that block defined.
- ``output`` (on a ```` ```text ```` block): what the Python block before it prints.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest
from markdown_it import MarkdownIt
from pytest_examples import CodeExample, EvalExample, find_examples

import tangram
from tangram._tools._cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

NOT_HERE = {
    "cluster": "needs a multi-node cluster",
    "remote-api": "calls a remote service that cannot be reached here",
    "training": "a framework's full training run",
}
SHELLS = {"sh", "bash", "console", "shell"}
#: Commands that serve until they are stopped (run briefly, see ``_serve_briefly``).
SERVERS = {"serve-sandbox-fusion"}
#: verl 0.9 imports Ray's state API from its old place; Ray warns, and the suite's
#: ``filterwarnings = error`` would fail the import. Ignored only where a block imports verl.
VERL_IMPORT_WARNING = r"Ray state API is no longer experimental"
_EXPORT = re.compile(r"^(?:\$ )?export (\w+)=(\S+)$")
_TESTS = re.compile(r"^(?:async )?def test_\w+\(", re.MULTILINE)
MARKERS = {*NOT_HERE, "gpu", "results", "continues", "output"}
_MARKER = re.compile(r"^<!--\s*test:\s*(\S+)\s*-->\s*$")


@attrs.frozen
class Fence:
    """One fenced block of a page, with the marker on the line before it (if any)."""

    page: Path
    line: int  # 1-based line of the opening fence, as pytest-examples counts it
    info: str
    content: str
    marker: str | None

    @property
    def commands(self) -> list[list[str]]:
        """The block's ``tangram`` command lines, as argv (continuations joined)."""
        if self.info not in SHELLS:
            return []
        joined = self.content.replace("\\\n", " ")
        lines = (line.strip().removeprefix("$ ") for line in joined.splitlines())
        return [shlex.split(line, comments=True) for line in lines if line.startswith("tangram ")]

    @property
    def exports(self) -> dict[str, str]:
        """The block's ``export NAME=VALUE`` lines."""
        if self.info not in SHELLS:
            return {}
        found = (_EXPORT.match(line.strip()) for line in self.content.splitlines())
        return {match.group(1): match.group(2) for match in found if match}


def _fences(page: Path) -> list[Fence]:
    fences: list[Fence] = []
    previous: Any = None
    for token in MarkdownIt().parse(page.read_text(encoding="utf-8")):
        if token.type == "fence" and token.map is not None:
            marker = None
            if previous is not None and previous.type == "html_block":
                found = _MARKER.match(previous.content.strip())
                marker = found.group(1) if found else None
            fences.append(Fence(page, token.map[0] + 1, token.info.strip(), token.content, marker))
        previous = token
    return fences


FENCES = {page: _fences(page) for page in PAGES}
EXAMPLES = {page: list(find_examples(page)) for page in PAGES}
PYTHON = [example for page in PAGES for example in EXAMPLES[page]]
COMMAND_PAGES = [page for page in PAGES if any(f.commands for f in FENCES[page])]


def _fence_of(example: CodeExample) -> Fence:
    for fence in FENCES[example.path]:
        if fence.line == example.start_line:
            return fence
    raise AssertionError(f"{example}: pytest-examples and markdown-it disagree on the fences")


def _shown_output(example: CodeExample) -> str | None:
    """The ``output`` text block after this Python block and before the next one."""
    fences = FENCES[example.path]
    after = [f for f in fences if f.line > example.start_line]
    for fence in after:
        if fence.info.startswith("py"):
            return None
        if fence.marker == "output":
            return fence.content
    return None


def _previous(example: CodeExample) -> CodeExample:
    before = [e for e in EXAMPLES[example.path] if e.start_line < example.start_line]
    assert before, f"{example} is marked `continues` but no Python block comes before it"
    return before[-1]


def _chain(example: CodeExample) -> list[CodeExample]:
    """The block and, while each is marked ``continues``, the blocks it builds on."""
    chain = [example]
    while _fence_of(chain[-1]).marker == "continues":
        chain.append(_previous(chain[-1]))
    return chain


def _source(example: CodeExample) -> str:
    return "".join(link.source for link in _chain(example))


RAY_BLOCKS = [example for example in PYTHON if "tangram.ray" in _source(example)]


def _why_not_here(marker: str | None) -> str | None:
    """Why a block with this marker cannot run here, or ``None`` when it can."""
    if marker in NOT_HERE:
        return NOT_HERE[marker]
    if marker == "gpu":
        no_gpu = "needs a CUDA GPU (runs on the device machine)"
        # No NVIDIA driver, no CUDA: decided without importing torch (seconds) first.
        if not Path("/proc/driver/nvidia/version").exists():
            return no_gpu
        try:
            import torch
        except ImportError:
            return no_gpu
        if not torch.cuda.is_available():
            return no_gpu
    return None


def _skip_unless_runnable(marker: str | None) -> None:
    reason = _why_not_here(marker)
    if reason is not None:
        pytest.skip(reason)


def _last_ray_block(example: CodeExample) -> bool:
    """Whether no Ray block after this one runs here."""
    later = RAY_BLOCKS[RAY_BLOCKS.index(example) + 1 :]
    runs = (all(_why_not_here(_fence_of(link).marker) is None for link in _chain(e)) for e in later)
    return not any(runs)


def test_every_marker_is_known_and_in_its_place() -> None:
    # A misspelt marker would silently run (or silently not compare) a block.
    for page in PAGES:
        for fence in FENCES[page]:
            where = f"{page.relative_to(ROOT)}:{fence.line}"
            assert fence.marker in {None, *MARKERS}, f"{where}: unknown marker {fence.marker!r}"
            if fence.marker == "output":
                assert fence.info == "text", f"{where}: `output` marks a ```text block"
            if fence.marker == "results":
                assert fence.commands, f"{where}: `results` marks a tangram command block"
            if fence.marker == "continues":
                assert fence.info.startswith("py"), f"{where}: `continues` marks a Python block"


def test_quickstart_shows_the_readmes_example() -> None:
    # docs/quickstart.md walks through the README's example step by step; keep them one.
    readme, quickstart = EXAMPLES[ROOT / "README.md"][0], EXAMPLES[ROOT / "docs/quickstart.md"][0]
    assert quickstart.source == readme.source
    assert _shown_output(quickstart) == _shown_output(readme) is not None


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Callable[[], None]]:
    """A real single-node Ray, as a reader's laptop would have (two CPUs), one for every block.

    It yields ``ray.shutdown``: the last Ray block stops it, so the blocks after it do
    not share the two cores with an idle Ray's daemons and workers.
    """
    ray = pytest.importorskip("ray")
    # address="local": a Ray of its own, never a cluster another process left running here.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield ray.shutdown
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def docker() -> None:
    """The real daemon and the image ``.ci/docker.sh`` builds; set up on CI, never skipped."""
    usable = anyio.run(tangram.DockerBackend.usable)
    if not usable and os.environ.get("CI"):
        subprocess.run(["bash", str(ROOT / ".ci" / "docker.sh")], check=True)
        usable = anyio.run(tangram.DockerBackend.usable)
        assert usable, "Docker is not usable even after .ci/docker.sh"
    if not usable:
        pytest.skip("no Docker daemon or test image here (run .ci/docker.sh); CI never skips")


@pytest.mark.parametrize("example", PYTHON, ids=str)
def test_python_block(
    example: CodeExample,
    eval_example: EvalExample,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fence = _fence_of(example)
    chain = _chain(example)
    for link in chain:
        _skip_unless_runnable(_fence_of(link).marker)
    source = _source(example)
    if "tangram.ray" in source:
        stop_ray = request.getfixturevalue("local_ray")
        if _last_ray_block(example):
            request.addfinalizer(stop_ray)
    if "DockerBackend" in source:
        request.getfixturevalue("docker")
    _export(example.path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    names: dict[str, Any] | None = None
    if fence.marker == "continues":
        names = _run_chain(_previous(example), eval_example)
        capsys.readouterr()
    shown = _shown_output(example)
    if shown is None and "tangram.ray" in source:
        # pytest-examples finds each print's line with inspect.stack(), which reads the
        # source of every frame on the stack; with Ray's modules loaded that takes
        # minutes per print. The `#>` lines are compared with what the block printed.
        shown = "".join(line.strip()[3:] + "\n" for line in _comments(example))
    with warnings.catch_warnings():
        if "verl" in source:
            warnings.filterwarnings("ignore", VERL_IMPORT_WARNING, DeprecationWarning)
        if shown is None:
            _run(eval_example.run_print_check, example, names)
        else:
            _run(eval_example.run, example, names)
            assert capsys.readouterr().out == shown
    if _TESTS.search(source):
        module = tmp_path / f"test_{example.path.stem}_{example.start_line}.py"
        module.write_text(source, encoding="utf-8")
        # pytest-asyncio (here for other tests) would warn that its loop scope is unset.
        run = ["-q", "-p", "no:cacheprovider", "-p", "no:asyncio", str(module)]
        assert pytest.main(run) == pytest.ExitCode.OK, f"{example}: its tests failed"


def _comments(example: CodeExample) -> list[str]:
    return [line for line in example.source.splitlines() if line.strip().startswith("#> ")]


def _run_chain(example: CodeExample, eval_example: EvalExample) -> dict[str, Any]:
    names = None
    if _fence_of(example).marker == "continues":
        names = _run_chain(_previous(example), eval_example)
    return _run(eval_example.run, example, names)


def _run(
    run: Callable[..., dict[str, Any]], example: CodeExample, names: dict[str, Any] | None
) -> dict[str, Any]:
    """Run a block; an error it raises fails the test naming the page's lines.

    pytest-examples re-raises a block's error with frames made to point into the page,
    and Python 3.11's traceback module fails on those frames (``StopIteration`` while
    reading their column positions, an INTERNALERROR that ends the whole session), so
    the lines are read here, without columns, and the error is reported by value.
    """
    try:
        return run(example, module_globals=names)
    except Exception as exc:
        lines = []
        frame = exc.__traceback__
        while frame is not None:
            lines.append(f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}")
            frame = frame.tb_next
        errors = "\n  ".join(_leaves(exc))
        raise AssertionError(f"{example} raised {errors}\n  at " + "\n  ".join(lines)) from None


def _leaves(exc: BaseException) -> list[str]:
    """``Type: message`` of the error, or of each error an exception group holds."""
    inner = getattr(exc, "exceptions", None)  # an exception group (the backport on 3.10)
    if isinstance(inner, tuple):
        return [leaf for error in inner for leaf in _leaves(error)]
    return [f"{type(exc).__name__}: {exc}"]


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_command_blocks(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _export(page, monkeypatch)
    monkeypatch.chdir(tmp_path)
    ran = 0
    for fence in FENCES[page]:
        if fence.marker in NOT_HERE or fence.marker == "results":
            continue
        _skip_unless_runnable(fence.marker)
        for argv in fence.commands:
            argv = [os.path.expandvars(arg) for arg in argv]
            where = f"{page.name}:{fence.line}: {shlex.join(argv)}"
            if argv[1] in SERVERS:
                _serve_briefly(argv[1:], where)
            else:
                assert cli_main(argv[1:]) == 0, where
            ran += 1
    if not ran:
        pytest.skip("every command block on this page is marked")


def _export(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set the page's ``export`` lines, with ``$PWD`` the repository, as a reader's shell has."""
    monkeypatch.setenv("PWD", str(ROOT))
    for fence in FENCES[page]:
        for name, value in fence.exports.items():
            monkeypatch.setenv(name, os.path.expandvars(value))


def _serve_briefly(args: list[str], where: str) -> None:
    """Start the server as the page does (on a free port), send it one request, stop it.

    A server runs until a signal stops it, so it gets a process of its own: SIGTERM is
    what a job scheduler sends, and the command must exit 0 on it.
    """
    if "--port" in args:
        args[args.index("--port") + 1] = "0"
    command = [sys.executable, "-m", "tangram._tools._cli", *args]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    started: re.Match[str] | None = None
    answer: Any = None
    try:
        assert server.stdout is not None
        started = re.search(r"http://\S+/run_code", server.stdout.readline())
        if started:
            code = {"code": "print(6 * 7)", "language": "python"}
            # trust_env=False: a proxy set for the host must not receive a loopback request.
            answer = httpx.post(started.group(0), json=code, timeout=60, trust_env=False).json()
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        _, errors = server.communicate(timeout=60)
    assert started, f"{where}: the server did not start (exit {server.returncode})\n{errors}"
    assert answer["status"] == "Success", f"{where}: {answer}"
    assert answer["run_result"]["stdout"] == "42\n", f"{where}: {answer}"
    assert server.returncode == 0, f"{where}: exit {server.returncode}\n{errors}"
