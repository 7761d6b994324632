"""tangram.config: the file every adapter worker reads, and the scheduler it opens."""

from __future__ import annotations

import ast
import contextlib
import json
import subprocess
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import tangram
from tangram import config as tc
from tangram._core._policies import DEFAULT_POLICY, POLICIES
from tangram._sandbox._backend import BACKENDS, SandboxBackend
from tangram._sim._baselines import run_policy

FULL = """
mode = "local"
[capacity]
cpu = 8
search = "5/s"
[policy]
name = "fcfs"
dop = 2
[sandbox]
backend = "docker"
image = "python:3.12-slim"
warm = 4
[gpu]
devices = { "cuda:0" = "80GiB" }
[[gpu.services]]
name = "judge"
factory = "pkg.mod:build"
memory = "2GiB"
[quota.search]
keys = [{ name = "a", requests = "50/s", concurrency = 8 }]
deadline = 30.0
[ray]
name = "sched"
namespace = "job"
[adapters.verl.reward]
service = "judge"
"""


def write(tmp_path: Path, text: str, name: str = "tangram.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_full_file_loads_into_a_checked_config(tmp_path: Path) -> None:
    config = tc.load(write(tmp_path, FULL))
    assert config.mode == "local"
    assert config.capacity == {"cpu": 8, "search": "5/s"}
    assert config.policy == tc.PolicyConfig(name="fcfs", options={"dop": 2})
    assert config.policy.build() == tangram.FcfsPolicy(dop=2)
    assert config.sandbox == tc.SandboxConfig(backend="docker", image="python:3.12-slim", warm=4)
    assert config.gpu is not None
    assert config.gpu.devices == {"cuda:0": "80GiB"}
    assert config.gpu.services == (
        tc.GpuServiceConfig(name="judge", factory="pkg.mod:build", memory="2GiB"),
    )
    assert config.quotas == (
        tc.QuotaConfig(
            name="search",
            keys=({"name": "a", "requests": "50/s", "concurrency": 8},),
            options={"deadline": 30.0},
        ),
    )
    assert config.ray == tc.RayConfig(name="sched", namespace="job")
    assert config.adapters == {"verl": {"reward": {"service": "judge"}}}
    assert config.source == str(tmp_path / "tangram.toml")


def test_json_with_the_same_structure_loads_the_same(tmp_path: Path) -> None:
    data = {"capacity": {"cpu": 4}, "policy": {"name": "elastic", "starvation_bound": 5.0}}
    config = tc.load(write(tmp_path, json.dumps(data), "tangram.json"))
    assert config.capacity == {"cpu": 4}
    assert config.policy is not None
    assert config.policy.build() == tangram.ElasticPolicy(starvation_bound=5.0)


def test_the_environment_variable_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tc.ENV_VAR, str(write(tmp_path, "[capacity]\ncpu = 2\n")))
    assert tc.load().capacity == {"cpu": 2}
    monkeypatch.delenv(tc.ENV_VAR)
    with pytest.raises(tc.ConfigError, match=r"\$TANGRAM_CONFIG is not set"):
        tc.load()


def test_config_error_is_a_tangram_error_and_a_value_error() -> None:
    assert issubclass(tc.ConfigError, tangram.errors.TangramError)
    assert issubclass(tc.ConfigError, ValueError)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("mode = 'cluster'\n[capacity]\ncpu = 1\n", r"`mode` must be one of"),
        ("[capacity]\ncpu = 1\n[sched]\nx = 1\n", r"unknown key\(s\) \['sched'\]"),
        ("[capacity]\ncpu = -1\n", r"\[capacity\]"),
        ("[capacity]\ncpu = 'lots'\n", r"\[capacity\]"),
        ("capacity = 3\n", r"\[capacity\] must be a table"),
        ("", r"nothing to schedule"),
        ("[capacity]\ncpu = 1\n[policy]\nname = 'lottery'\n", r"'elastic' or 'fcfs'"),
        ("[capacity]\ncpu = 1\n[policy]\nname = 'fcfs'\ndop = 0\n", r"\[policy\] fcfs"),
        ("[capacity]\ncpu = 1\n[policy]\nwindow = 'x'\nbogus = 1\n", r"\[policy\] elastic"),
        # The file too, as every other mistake says it (a review found it left out).
        ("[capacity]\ncpu = 1\n[policy]\nbogus = 1\n", r"tangram.toml'?: \[policy\] elastic"),
        ("[gpu]\ndevices = {'cuda:0' = 'lots'}\n", r"\[gpu\] `devices` 'cuda:0'"),
        ("[[gpu.services]]\nname = 'j'\nfactory = 'a:b'\nmemory = 'huge'\n", r"`memory`"),
        ("[sandbox]\nbackend = 'vm'\n", r"`backend` must be one of"),
        ("[sandbox]\nimage = 'python:3'\n", r"`image` is for the docker backend"),
        ("[sandbox]\nwarm = -2\n", r"`warm` must be a whole number"),
        ("[sandbox]\ntimeout = 0\n", r"`timeout` must be a number of seconds"),
        ("[gpu]\ndevices = {}\n", r"at least one \[\[gpu.services\]\]"),
        ("[[gpu.services]]\nname = 'j'\nfactory = 'nocolon'\n", r"'module:function'"),
        ("[[gpu.services]]\nfactory = 'a:b'\n", r"`name` must be a non-empty string"),
        ("[gpu]\nmystery = 1\n", r"unknown key\(s\) \['mystery'\]"),
        ("[quota.search]\nkeys = []\n", r"\[quota.search\] `keys` must be a non-empty list"),
        ("[capacity]\ncpu = 1\n[ray]\nname = ''\n", r"\[ray\]: `name` must be a non-empty"),
        ("[capacity]\ncpu = 1\n[ray]\nport = 1\n", r"unknown key\(s\) \['port'\]"),
        ("[capacity]\ncpu = 1\n[ray]\ndetached = 'yes'\n", r"`detached` must be true or false"),
        ("record = ''\n[capacity]\ncpu = 1\n", r"`record` must be a directory path"),
        ("record = 3\n[capacity]\ncpu = 1\n", r"`record` must be a directory path"),
        ("mode = 'ray'\nrecord = 't'\n[capacity]\ncpu = 1\n", r"`record` needs mode = 'local'"),
        ("[capacity]\ncpu = 1\n[ray]\nlease_timeout = 0\n", r"`lease_timeout` must be"),
        ("[capacity]\ncpu = 1\n[ray]\nheartbeat = 'x'\n", r"`heartbeat` must be"),
        (
            "[capacity]\ncpu = 1\n[ray]\nheartbeat = 2\nlease_timeout = 3\n",
            r"at least twice `heartbeat` \(got 3 s < 2 x 2 s\)",
        ),
    ],
)
def test_mistakes_fail_at_load_naming_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(tc.ConfigError, match=match):
        tc.load(write(tmp_path, text))


def test_unreadable_files_fail_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(tc.ConfigError, match="cannot read"):
        tc.load(tmp_path / "missing.toml")
    with pytest.raises(tc.ConfigError, match="invalid TOML"):
        tc.load(write(tmp_path, "[capacity\n"))
    with pytest.raises(tc.ConfigError, match="invalid JSON"):
        tc.load(write(tmp_path, "{", "t.json"))
    with pytest.raises(tc.ConfigError, match="top level must be an object"):
        tc.load(write(tmp_path, "[1]", "t.json"))
    with pytest.raises(tc.ConfigError, match=r"\.toml or \.json"):
        tc.load(write(tmp_path, "cpu = 1", "t.ini"))
    # Bytes no one here wrote: not UTF-8, a number past 4,300 digits, nesting past the
    # interpreter's recursion (each was a bare UnicodeDecodeError, ValueError or
    # RecursionError).
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[capacity]\ncpu = 1\n# \xff\n")
    with pytest.raises(tc.ConfigError, match="cannot read"):
        tc.load(bad)
    with pytest.raises(tc.ConfigError, match="invalid JSON"):
        tc.load(write(tmp_path, '{"capacity": {"cpu": ' + "9" * 5000 + "}}", "t.json"))
    with pytest.raises(tc.ConfigError, match="invalid JSON"):
        tc.load(write(tmp_path, "[" * 100_000 + "]" * 100_000, "t.json"))


@pytest.mark.anyio
async def test_local_mode_opens_a_runtime_with_the_policy(tmp_path: Path) -> None:
    config = tc.load(
        write(tmp_path, "mode = 'local'\n[capacity]\ncpu = 4\n[policy]\nname = 'fcfs'\ndop = 1\n")
    )
    async with tc.open_scheduler(config, capacity={"cpu": 99, "gpu_mem:cpu:0": 1024}) as rt:
        assert isinstance(rt, tangram.Runtime)
        assert tangram.current_runtime() is rt
        # The file's values win; run-time resources (a pool's) are added.
        assert rt.capacity["cpu"].total == 4
        assert rt.capacity["gpu_mem:cpu:0"].total == 1024
        async with tangram.acquire(cpu=tangram.Elastic(1, 4)) as lease:
            assert lease.units == 1  # FCFS at dop 1: the configured policy decides
    with pytest.raises(tangram.errors.NoCurrentRuntimeError):
        tangram.current_runtime()


@pytest.mark.anyio
async def test_local_mode_records_what_it_served_as_a_trace(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    config = tc.load(
        write(tmp_path, f"mode = 'local'\nrecord = {str(folder)!r}\n[capacity]\ncpu = 2\n")
    )
    for _ in range(2):  # two schedulers (processes or loops) never share a file
        async with tc.open_scheduler(config):
            for _ in range(3):
                async with tangram.acquire(cpu=tangram.Elastic(1, 2), trajectory="t0"):
                    await anyio.sleep(0.01)
    files = sorted(folder.iterdir())
    assert len(files) == 2
    trace = tangram.read_trace(files[0])
    assert (trace.name, trace.actions, trace.capacity) == (files[0].stem, 3, {"cpu": 2.0})
    result = run_policy("tangram", trace)  # and it replays
    assert len(result.records) == 3


@pytest.mark.anyio
@pytest.mark.parametrize("create", [True, False])
async def test_ray_mode_connects_lazily_with_the_files_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, create: bool
) -> None:
    """``tangram.ray`` is replaced by a recorder: what is tested is the dispatch to it."""
    calls: list[dict[str, Any]] = []
    proxy = object()

    @contextlib.asynccontextmanager
    async def connect(**kwargs: Any) -> AsyncIterator[object]:
        calls.append(kwargs)
        yield proxy

    fake = types.ModuleType("tangram.ray")
    fake.connect = connect  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tangram.ray", fake)
    monkeypatch.setattr(tangram, "ray", fake, raising=False)
    text = (
        'mode = "ray"\n[capacity]\ncpu = 16\n[policy]\nname = "fcfs"\ndop = 2\n'
        '[ray]\nname = "sched"\nnamespace = "job"\naddress = "auto"\n'
        f"create = {str(create).lower()}\ndetached = true\n"
    )
    config = tc.load(write(tmp_path, text))
    assert calls == []  # loading connects to nothing
    async with tc.open_scheduler(config, capacity={"search": "1/s"}) as scheduler:
        assert scheduler is proxy
    assert calls == [
        {
            "name": "sched",
            "namespace": "job",
            "address": "auto",
            # A worker that only looks the actor up states no capacity to be refused.
            "capacity": {"search": "1/s", "cpu": 16} if create else None,
            "create": create,
            "detached": True,
            "policy": tangram.FcfsPolicy(dop=2),
            "heartbeat": 1.0,
            "lease_timeout": 10.0,
        }
    ]


def test_a_file_without_mode_shares_one_scheduler_per_job(tmp_path: Path) -> None:
    config = tc.load(write(tmp_path, "[capacity]\ncpu = 1\n[ray]\nlease_timeout = 4\n"))
    assert config.mode == "shared"
    assert (config.ray.heartbeat, config.ray.lease_timeout) == (1.0, 4.0)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_shared_mode_outside_ray_shares_the_jobs_scheduler_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No Ray job here: shared mode reaches the job's scheduler process on this node, the
    same one for every scheduler the file opens (tests/test_node.py covers processes)."""
    monkeypatch.setenv("TANGRAM_RUN_DIR", str(tmp_path / "run"))
    config = tc.load(write(tmp_path, "[capacity]\ncpu = 2\n", "shared.toml"))
    async with tc.open_scheduler(config) as first, tc.open_scheduler(config) as second:
        assert not isinstance(first, tangram.Runtime)
        assert first.capacity["cpu"].total == 2
        async with first.acquire(cpu=2):
            with anyio.move_on_after(0.3) as waited:
                async with second.acquire(cpu=1):
                    pass
            assert waited.cancelled_caught  # one limit for both: the second waited


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.anyio
async def test_shared_mode_on_trio_says_to_use_local_mode(tmp_path: Path) -> None:
    config = tc.load(write(tmp_path, "[capacity]\ncpu = 2\n"))
    with pytest.raises(tangram.errors.AsyncioRequiredError, match="mode = 'local'"):
        async with tc.open_scheduler(config):
            pass


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_record_in_shared_mode_is_refused(tmp_path: Path) -> None:
    config = tc.load(write(tmp_path, f"record = {str(tmp_path)!r}\n[capacity]\ncpu = 2\n"))
    with pytest.raises(tc.ConfigError, match="mode = 'local'"):
        async with tc.open_scheduler(config):
            pass


def test_local_mode_never_imports_ray(tmp_path: Path) -> None:
    path = write(tmp_path, "[capacity]\ncpu = 1\n")
    code = (
        "import sys, anyio, tangram.config as tc\n"
        "async def main():\n"
        f"    async with tc.open_scheduler(tc.load({str(path)!r})):\n"
        "        pass\n"
        "anyio.run(main)\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
        "assert 'tangram.ray' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- names come from the registries; reading a file opens nothing -------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_registered_policy_is_a_config_value(name: str) -> None:
    config = tc.parse({"capacity": {"cpu": 1}, "policy": {"name": name}})
    assert config.policy is not None
    assert type(config.policy.build()) is POLICIES[name]
    assert tc.PolicyConfig().name == DEFAULT_POLICY


def test_a_policy_no_registry_has_is_a_config_error_when_built() -> None:
    with pytest.raises(tc.ConfigError, match=r"\[policy\] lottery: no policy named 'lottery'"):
        tc.PolicyConfig(name="lottery").build()


class _Imaged(SandboxBackend):
    """A backend read with the default ``from_options``: its keywords are its keys."""

    def __init__(self, *, image: str | None = None, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"`size` must be at least 1 (got {size})")
        self.image = image
        self.size = size

    async def start(self) -> Any:
        return []

    async def create(self, host: Any) -> Any:
        raise NotImplementedError


class _Plain(_Imaged):
    def __init__(self, *, size: int = 1) -> None:
        super().__init__(size=size)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two more backends in the registry, from a module only it names."""
    module = types.ModuleType("tangram_test_backends")
    module.Imaged = _Imaged  # type: ignore[attr-defined]
    module.Plain = _Plain  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(BACKENDS, "imaged", "tangram_test_backends:Imaged")
    monkeypatch.setitem(BACKENDS, "plain", "tangram_test_backends:Plain")


def test_a_registered_backend_is_a_config_value_built_from_its_options(registered: None) -> None:
    from tangram._frameworks._session import _backend

    data = {"sandbox": {"backend": "imaged", "image": "py:3", "size": 3, "warm": 1}}
    config = tc.parse(data)
    assert config.sandbox == tc.SandboxConfig(
        backend="imaged", image="py:3", warm=1, options={"size": 3}
    )
    built = _backend(config.sandbox)
    assert isinstance(built, _Imaged)
    assert (built.image, built.size) == ("py:3", 3)
    for options, match in (({"bogus": 1}, "bogus"), ({"size": 0}, "at least 1")):
        bad = tc.SandboxConfig(backend="plain", options=options)
        with pytest.raises(tc.ConfigError, match=rf"\[sandbox\]: .*{match}"):
            _backend(bad)


def test_image_is_refused_where_the_backend_takes_none(registered: None) -> None:
    with pytest.raises(tc.ConfigError, match=r"`image` is for the docker or imaged backend"):
        tc.parse({"sandbox": {"backend": "plain", "image": "py:3"}})
    with pytest.raises(tc.ConfigError, match=r"must be one of \['docker', 'imaged', 'local'"):
        tc.parse({"sandbox": {"backend": "vm"}})


def _internal_imports(module: str) -> set[str]:
    """The tangram modules ``tangram/_frameworks/<module>.py`` imports, as ``_core._policy``."""
    path = Path(tangram.__file__).parent / "_frameworks" / f"{module}.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ["_frameworks"][: 2 - node.level]
            found.add(".".join([*base, *(node.module or "").split(".")]).strip("."))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tangram"):
            found.add(node.module.removeprefix("tangram").strip("."))  # type: ignore[union-attr]
    return found


def test_config_then_scheduler_then_session_in_one_direction() -> None:
    # Reading a file needs the pure core, the errors and the backends' names: nothing
    # that starts a runtime, a pool or a process.
    read = _internal_imports("_config")
    assert read, "the checker found no import"
    assert all(name.startswith(("_core.", "_sandbox._backend", "errors")) for name in read), read
    opened = _internal_imports("_open")
    assert "_frameworks._config" in opened
    assert not {"_frameworks._session"} & opened
    assert {"_frameworks._config", "_frameworks._open"} <= _internal_imports("_session")
