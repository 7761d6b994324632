"""What the model controls never fails the step: a re-attack of the adapters' failure rule.

Once every exception of tangram's part of a call but a bad argument counted as tangram's,
an input the model controls that made tangram raise anything else became a stop of
training it could call at will. A hostile re-review drove each input below through the
adapters: a non-finite ``cpu`` a function tool passes from the model into ``run_code``
(``math.ceil(nan)`` raised a bare ``ValueError``, counted as tangram's: a ``FAILED_CALL``
and an unscored sample) failed; the rest (hostile code, arguments and answers) held.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

verl = pytest.importorskip("verl") if not os.environ.get("CI") else __import__("verl")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from _tiny import tiny_tokenizer
    from tangram_verl import run_code, with_tangram
    from tangram_verl.reward import refuse_failed
    from tangram_verl.tools import FAILED_CALL
    from test_failures import verl_config  # noqa: F401 (a fixture)
    from test_verl import TOOLS_YAML, _agent_loop, _Server
    from verl.tools.function_tool import function_tool, get_function_tool
    from verl.tools.tool_registry import initialize_tools_from_config

from tangram import integrations  # noqa: E402
from tangram._frameworks import _failures  # noqa: E402
from tangram._sandbox._local._backend import _LocalHandle  # noqa: E402
from tangram.errors import (  # noqa: E402
    InvalidDemandError,
    UnscoredSampleError,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


NON_FINITE = [math.nan, math.inf, -math.inf]


# ---------------------------------------------------------------------------------------
# F1: a non-finite `cpu` the model passes through a with_tangram function tool into
#     run_code is a FAILED_CALL (NaN tool reward -> UnscoredSampleError: the step fails)
# ---------------------------------------------------------------------------------------


_REGISTERED: dict[str, Any] = {}


def _reattack_run() -> Any:
    """A with_tangram function tool whose `cpu` argument is the model's; registered once,
    after the fixture named the config (with_tangram checks it where it decorates)."""
    if "fn" not in _REGISTERED:

        @function_tool("reattack_run")
        @with_tangram(kind="reattack_run")
        async def reattack_run(code: str, cpu: float = 1) -> str:
            """Run Python in a sandbox on `cpu` cores.

            Args:
                code: the program.
                cpu: how many cores the program may use.
            """
            return format(await run_code(code, cpu=cpu))

        _REGISTERED["fn"] = reattack_run
    return _REGISTERED["fn"]


@pytest.mark.anyio
@pytest.mark.parametrize("cpu", NON_FINITE, ids=["nan", "inf", "-inf"])
async def test_a_non_finite_cpu_from_the_model_is_not_tangrams_failure(
    verl_config: Path, cpu: float
) -> None:
    """The model's `cpu` (JSON's NaN/Infinity, which verl's json.loads accepts) reaches
     Sandbox.run, whose fraction handling calls math.ceil(cpu) before any check
    : a bare ValueError/OverflowError, which run_code wraps
     as SandboxError, which with_tangram counts as tangram's failure
    : FAILED_CALL + NaN, and the sample is refused. A bad demand the
     function builds from the model's arguments is meant to be the call's (as cpu=-1 or
     cpu=10**6 already are: InvalidDemandError, shown to the model)."""
    outcome: Any
    try:
        outcome = await _reattack_run()(code="print(1)", cpu=cpu)
    except InvalidDemandError:
        outcome = "answered to the model"
    assert _failures.counts() == {}, f"counted as tangram's failure: {_failures.counts()}"
    text = getattr(outcome[0], "text", None) if isinstance(outcome, tuple) else None
    assert text != FAILED_CALL, "the model's own cpu value made the call a FAILED_CALL"


@pytest.mark.anyio
async def test_the_models_nan_cpu_never_fails_the_step(verl_config: Path, tmp_path: Path) -> None:
    """Through verl's ToolAgentLoop: the model writes `"cpu": NaN` in its tool call; the
    trajectory gets a NaN tool reward and tangram's reward refuses the sample."""
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    body = json.dumps({"name": "reattack_run", "arguments": {"code": "print(1)", "cpu": math.nan}})
    assert "NaN" in body
    server = _Server(tokenizer, [f"<tool_call>{body}</tool_call><|im_end|>", "done<|im_end|>"])
    _reattack_run()
    loop = _agent_loop(tokenizer, server, [get_function_tool("reattack_run")])
    output = await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "go"}])
    seen = "".join(server.prompts[1:])
    refused = False
    try:
        refuse_failed(output.extra_fields)
    except UnscoredSampleError:
        refused = True
    assert FAILED_CALL not in seen and not refused, (
        "the model's NaN cpu failed the training step (FAILED_CALL shown, sample refused)"
    )


@pytest.mark.anyio
@pytest.mark.parametrize("cpu", NON_FINITE, ids=["nan", "inf", "-inf"])
async def test_sandbox_run_refuses_a_non_finite_cpu_typed(verl_config: Path, cpu: float) -> None:
    """The root: Sandbox.run's type check lets any float through, and the pool computes
    ceil(cpu) before the runtime validates the demand: an untyped ValueError/OverflowError,
    which is_infrastructure (everything but InvalidSettingError) counts as tangram's."""
    async with (
        integrations.session(None) as resources,
        resources.sandbox_pool().sandbox("reattack-cpu") as sandbox,
    ):
        with pytest.raises(InvalidDemandError):
            await sandbox.run(code="print(1)", cpu=cpu)


@pytest.mark.anyio
@pytest.mark.parametrize("cpu", [-0.5, -1.5])
async def test_a_negative_fractional_cpu_is_refused_not_run(verl_config: Path, cpu: float) -> None:
    """Same line: max(1, ceil(-1.5)) == 1 and throttle = -1.5, so a
    negative demand runs on one core instead of being refused as cpu=-1 is
    (InvalidDemandError). Not a step failure, but the check that closes F1 must also
    close it."""
    async with (
        integrations.session(None) as resources,
        resources.sandbox_pool().sandbox("reattack-neg") as sandbox,
    ):
        with pytest.raises(InvalidDemandError):
            await sandbox.run(code="print(1)", cpu=cpu)


# ---------------------------------------------------------------------------------------
# converse (expected to PASS): a real tangram failure never reaches the model
# ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_converse_a_backend_bug_under_with_tangram_is_still_a_failed_call(
    verl_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def execute(self: Any, request: Any) -> Any:
        raise AttributeError("<<tangram-internal-bug>>")

    monkeypatch.setattr(_LocalHandle, "execute", execute)
    response, reward, _ = await _reattack_run()(code="print(1)", cpu=1)
    assert response.text == FAILED_CALL and math.isnan(reward)
    assert _failures.counts() == {"reattack_run": 1}


@pytest.mark.anyio
async def test_converse_a_backend_bug_under_sandbox_tool_is_kept_for_release(
    verl_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def execute(self: Any, request: Any) -> Any:
        raise AttributeError("<<tangram-internal-bug>>")

    monkeypatch.setattr(_LocalHandle, "execute", execute)
    tool = initialize_tools_from_config(str(TOOLS_YAML))[0]
    instance, _ = await tool.create()
    with pytest.raises(AttributeError):
        await tool.execute(instance, {"code": "print(1)"})
    with pytest.raises(AttributeError):
        await tool.release(instance)
    assert sum(_failures.counts().values()) == 1


# ---------------------------------------------------------------------------------------
# the model's hostile code and arguments are answered to it
# ---------------------------------------------------------------------------------------

HOSTILE_CODE = {
    "killpg": "import os,signal; os.killpg(0, signal.SIGKILL)",
    "kill_all": (
        "import os,signal\ntry: os.kill(-1, signal.SIGKILL)\nexcept Exception as e: print(e)"
    ),
    "close_std_fds": "import os; os.close(0); os.close(1); os.close(2)",
    "binary_output": "import sys; sys.stdout.buffer.write(bytes(range(256))*4000)",
    "chmod_workdir_0": "import os; os.chmod('.', 0)",
    "fill_disk": (
        "f=open('big','wb')\ntry:\n  while True: f.write(b'x'*(1<<20))\n"
        "except Exception as e: print(e)"
    ),
    "fill_inodes": (
        "import os\ntry:\n  for i in range(10**6): open(f'f{i}','w').close()\n"
        "except Exception as e: print(e)"
    ),
    "fork_bomb": (
        "import os,time\nfor i in range(2000):\n  try: os.fork()==0 and time.sleep(30)\n"
        "  except Exception as e: print(e); break"
    ),
    "daemon": "import os,time\nif os.fork()==0:\n  os.setsid()\n  if os.fork()==0: time.sleep(100)",
    "kill_parent": "import os,signal; os.kill(os.getppid(), signal.SIGKILL)",
}
HOSTILE_ARGS = [
    {"code": "print(1)", "timeout": 5e-324},
    {"code": "print(1)", "timeout": 1.7e308},
    {"code": "print(1)", "timeout": math.nan},
    {"code": "print(1)", "timeout": 2**1023},
    {"code": "print(1)", "language": "shell", "cpu": 10**9, "extra": {"a": [1]}},
    {"code": "x\0y", "language": "bash"},
    {"code": "\ud800"},
    {"code": "#" * (200 << 10)},
]


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(HOSTILE_CODE))
async def test_held_hostile_code_is_the_models_result(verl_config: Path, name: str) -> None:
    tool = initialize_tools_from_config(str(TOOLS_YAML))[0]
    tool.timeout = 8
    instance, _ = await tool.create()
    try:
        await tool.execute(instance, {"code": HOSTILE_CODE[name]})
        response, _, _ = await tool.execute(instance, {"code": "print('alive')"})
        assert "alive" in response.text
    finally:
        await tool.release(instance)
    assert _failures.counts() == {}


@pytest.mark.anyio
@pytest.mark.parametrize("parameters", HOSTILE_ARGS, ids=lambda p: repr(p)[:40])
async def test_held_hostile_arguments_are_answered(verl_config: Path, parameters: Any) -> None:
    tool = initialize_tools_from_config(str(TOOLS_YAML))[0]
    tool.timeout = None
    instance, _ = await tool.create()
    try:
        try:
            response, _, _ = await tool.execute(instance, parameters)
            assert isinstance(response.text, str)
        except Exception as exc:  # verl shows it; it must not be tangram's
            assert not integrations.is_infrastructure(exc), exc
    finally:
        await tool.release(instance)
    assert _failures.counts() == {}


HOSTILE_ANSWERS = {
    "nul": "def add(a,b):\x00 return a+b",
    "bogus_coding": "# coding: bogus\ndef add(a,b): return a+b",
    "deep_parens": "x=" + "(" * 5000 + ")" * 5000,
    "bigint": "x=1" + "0" * 100000,
    "big": "def add(a,b): return a+b\n" + "#" * (4 << 20),
    "lambda_deep": "x=" + "lambda:" * 3000 + "1",
    "surrogate": "def add(a,b): return a+b  # \udc80",
}


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(HOSTILE_ANSWERS))
async def test_held_hostile_answers_are_scored_not_raised(verl_config: Path, name: str) -> None:
    async with (
        integrations.session(None) as resources,
        resources.sandbox_pool().sandbox("reattack-grade") as sandbox,
    ):
        verdict = await integrations.grade(
            sandbox, HOSTILE_ANSWERS[name], "assert add(2, 3) == 5", timeout=20
        )
    assert verdict.total == 1
