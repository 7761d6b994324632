"""verl's SandboxFusion paths against tangram (issue #18, "verl-native pieces").

The clients are verl's own: ``verl.utils.reward_score.sandbox_fusion`` (what
``reward.sandbox_fusion.url`` drives, through verl's naive reward manager under its reward
loop worker) calls tangram's ``run_code`` server on loopback; a tool YAML written for
``SandboxFusionTool`` loads with ``initialize_tools_from_config`` once its ``class_name``
names tangram's ``SandboxTool``, and runs under ``ToolAgentLoop`` with the dataset's
``create_kwargs``. Sandboxes are real (tangram's local backend); the LLM server behind
the agent loop is the one stand-in, as in test_verl.py.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import numpy as np
import pytest

verl = pytest.importorskip("verl") if not os.environ.get("CI") else __import__("verl")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch
    from _tiny import per_process, tiny_tokenizer
    from omegaconf import OmegaConf
    from test_verl import _agent_loop, _Server
    from verl import DataProto
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.tools.tool_registry import initialize_tools_from_config
    from verl.utils.reward_score.sandbox_fusion.utils import call_sandbox_api

from tangram_verl import SandboxTool  # noqa: E402

import tangram  # noqa: E402
from tangram import _fusion  # noqa: E402
from tangram._frameworks import _failures, _session  # noqa: E402
from tangram.errors import SandboxBrokenError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TANGRAM_TOML = per_process("tangram.toml")

# A SandboxFusionTool entry as verl's examples write it; only class_name changed.
FUSION_YAML = """
tools:
  - class_name: tangram_verl.tools.SandboxTool
    config:
      type: native
      sandbox_fusion_url: http://127.0.0.1:8080/run_code
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 30
      default_language: python
      memory_limit_mb: 1024
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: A tool for executing code.
        parameters:
          type: object
          properties:
            code:
              type: string
              description: The code to execute.
          required: [code]
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """tangram's run_code server on a free loopback port, over the docs' config."""
    monkeypatch.setenv("TANGRAM_CONFIG", str(TANGRAM_TOML))
    _failures.reset()
    async with _fusion.serve(port=0) as url:
        yield f"{url}/run_code"
    await _session.aclose()


async def _call(url: str, code: str, stdin: str | None = None, language: str = "python") -> Any:
    """verl's own client (blocking ``requests``), in a thread as verl's reward workers run it."""
    return await anyio.to_thread.run_sync(
        call_sandbox_api, url, code, stdin, 10, 10, 1024, language
    )


@pytest.mark.anyio
async def test_verls_client_runs_code_on_tangrams_pool(server: str) -> None:
    response, error = await _call(server, "import sys; print(sys.stdin.read()[::-1])", "abc")
    assert error is None
    assert response["status"] == "Success"
    assert response["run_result"]["status"] == "Finished"
    assert response["run_result"]["return_code"] == 0
    assert response["run_result"]["stdout"] == "cba\n"
    response, error = await _call(server, "echo out; echo err >&2; exit 3", language="bash")
    assert response["status"] == "Failed"
    assert response["run_result"]["return_code"] == 3
    assert (response["run_result"]["stdout"], response["run_result"]["stderr"]) == (
        "out\n",
        "err\n",
    )
    # A language SandboxFusion has and tangram does not serve: refused, not scored as code.
    response, error = await _call(server, "int main() {}", language="cpp")
    assert response is None and "501" in error
    async with _session.session() as resources:
        stats = resources.scheduler.stats()
        assert stats.kinds["sandbox_fusion"].completed == 2
        assert stats.resources["cpu"].held == 0


@pytest.mark.anyio
async def test_files_timeouts_and_ping_as_sandboxfusion_answers_them(server: str) -> None:
    base = server.rsplit("/", 1)[0]
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f"{base}/v1/ping")).json() == "pong"
        body = {
            "code": "print(open('in.txt').read()); open('out.txt', 'w').write('made')",
            "language": "python",
            "files": {"in.txt": base64.b64encode(b"given").decode()},
            "fetch_files": ["out.txt", "missing.txt"],
        }
        answer = (await client.post(server, json=body)).json()
        assert answer["run_result"]["stdout"] == "given\n"
        assert answer["files"] == {"out.txt": base64.b64encode(b"made").decode()}
        slow = {"code": "import time; time.sleep(30)", "language": "python", "run_timeout": 0.5}
        answer = (await client.post(server, json=slow)).json()
        assert answer["status"] == "Failed"
        assert answer["run_result"]["status"] == "TimeLimitExceeded"
        refused = await client.post(server, json={"language": "python"})
        assert refused.status_code == 422


@pytest.mark.anyio
async def test_a_broken_sandbox_is_a_server_error_not_a_verdict(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise SandboxBrokenError("gone")

    monkeypatch.setattr(tangram.Sandbox, "run", broken)
    response, error = await _call(server, "print(1)")
    assert response is None
    assert "503" in error
    assert _failures.counts() == {"sandbox_fusion": 1}


def _codecontests_batch(tokenizer: Any, answers: list[str], tests: dict[str, Any]) -> DataProto:
    prompt = tokenizer.encode("Q", add_special_tokens=False)
    encoded = [tokenizer.encode(a, add_special_tokens=False) for a in answers]
    width = max(len(ids) for ids in encoded)
    responses = [ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in encoded]
    masks = [[1] * (len(prompt) + len(ids)) + [0] * (width - len(ids)) for ids in encoded]
    n = len(answers)
    return DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([prompt] * n),
            "responses": torch.tensor(responses),
            "attention_mask": torch.tensor(masks),
        },
        non_tensors={
            "data_source": np.array(["codecontests"] * n, dtype=object),
            "reward_model": np.array([{"ground_truth": json.dumps(tests)}] * n, dtype=object),
            "extra_info": np.array([{} for _ in answers], dtype=object),
        },
    )


@pytest.mark.anyio
async def test_reward_sandbox_fusion_url_scores_through_tangram(
    server: str, tmp_path: Path
) -> None:
    """verl's naive reward manager with ``reward.sandbox_fusion.url`` set, unchanged."""
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": str(tmp_path / "tok"), "tokenizer_path": None}},
            "reward": {
                "reward_model": {"enable": False},
                "custom_reward_function": {"path": None, "name": None, "reward_kwargs": {}},
                "reward_manager": {"source": "register", "name": "naive", "module": {"path": None}},
                "sandbox_fusion": {"url": server, "max_concurrent": 8, "memory_limit_mb": 1024},
            },
        }
    )
    tests = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    worker = RewardLoopWorker(config)
    data = _codecontests_batch(tokenizer, [right, wrong], tests)
    outputs = await worker.compute_score_batch(data)
    assert [o["reward_score"] for o in outputs] == [1.0, 0.0]
    async with _session.session() as resources:
        # Two answers, two cases each: four runs admitted by tangram's scheduler.
        assert resources.scheduler.stats().kinds["sandbox_fusion"].completed == 4


@pytest.mark.anyio
async def test_a_sandboxfusion_tool_yaml_runs_on_tangram_with_create_kwargs(
    server: str, tmp_path: Path
) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(FUSION_YAML)
    (tool,) = initialize_tools_from_config(str(path))
    assert isinstance(tool, SandboxTool)
    assert (tool.timeout, tool.language, tool.cpu) == (30, "python", 1)
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    code = "print(open('d.txt').read())"
    call = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
    llm = _Server(tokenizer, [f"<tool_call>{call}</tool_call><|im_end|>", "ok<|im_end|>"])
    loop = _agent_loop(tokenizer, llm, [tool])
    # The dataset's tools_kwargs, as verl passes them to create() before the first call.
    create = {"files": {"d.txt": "from the dataset\n"}, "setup": "echo set up >> d.txt"}
    output = await loop.run(
        {"temperature": 1.0},
        raw_prompt=[{"role": "user", "content": "go"}],
        tools_kwargs={"code_interpreter": {"create_kwargs": create}},
    )
    tool_turn = llm.prompts[1].rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    assert tool_turn == "from the dataset\nset up\n\n"
    # The call's grant and timing, kept where verl carries them to the reward managers.
    totals = output.extra_fields["extras"]["tangram"]
    assert totals["tool_calls"] == 1
    assert totals["tool_cores"] == 1
    assert totals["tool_exec_seconds"] > 0


def test_the_cli_serves_until_sigterm(tmp_path: Path) -> None:
    """The docs' own config, shared mode outside Ray: the server's sandboxes come from the
    job's scheduler process on this node, which the server starts."""
    env = {
        **os.environ,
        "TANGRAM_CONFIG": str(ROOT / "docs" / "examples" / "tangram.toml"),
        "TANGRAM_RUN_DIR": str(tmp_path / "run"),
        "TANGRAM_JOB": f"fusion-{tmp_path.name}",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "tangram._tools._cli", "serve-sandbox-fusion", "--port", "0"],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("serving SandboxFusion run_code at http://127.0.0.1:")
        url = line.split()[-1]
        response, error = call_sandbox_api(url, "print(6 * 7)", None, 10, 10, 1024, "python")
        assert error is None and response["run_result"]["stdout"] == "42\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
