"""``mode = "shared"`` (the default) on a real local Ray cluster: one scheduler per job.

The adapters run in Ray actors the test starts as verl and OpenRLHF start theirs (worker
processes tangram never sees start, sharing nothing but the config file), with the docs'
own configs (their ``lease_timeout`` shortened so the lifetime tests finish sooner). The
first worker creates the job's scheduler actor and its node's host agent; later ones
find them. ``ray.cluster_utils.Cluster`` gives a head and a second node as separate
raylets on this machine.

What runs is real: verl's tool loader builds the tools from the docs' YAML, and the four
agent-loop workers run verl's own ``ToolAgentLoop`` over them (the other verl tests call
the tool's ``create``/``execute``/``release`` as ``ToolAgentLoop._call_tool`` does);
OpenRLHF's own ``MultiTurnAgentExecutor.execute`` drives the adapter's
``AgentInstance``; sandboxes are tangram's local backend; the judge is a real torch
module. Stand-ins: the LLM server behind verl's agent loop and the engine behind
OpenRLHF's executor (vLLM needs a GPU), which return fixed turns through a real
tokenizer, and the judge's device, a ``cpu:0`` Device (no GPU here). The OpenRLHF config
scores with the docs' own ``reward = "tests"``: the sealed code grader, on a sandbox of
the node's agent.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI"):
    import ray
    import torch
else:
    ray = pytest.importorskip("ray")
    torch = pytest.importorskip("torch")

import ray.cluster_utils
from _probes import PROBE, assert_never_shared, probes
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tangram._shared._on_ray import NAMESPACE, agent_name, host_name, scheduler_name
from tangram._shared._proxy import attach

# The actors below are defined here, in a module Ray's workers import by value.
importlib.import_module("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "examples"
LEASE_TIMEOUT = 5.0


def _config(tmp_path: Path, name: str, replace: dict[str, str] | None = None) -> Path:
    text = (DOCS / name).read_text()
    text = text.replace("lease_timeout = 10", f"lease_timeout = {LEASE_TIMEOUT:g}\nheartbeat = 0.5")
    if "lease_timeout" not in text:
        text += f"\n[ray]\nlease_timeout = {LEASE_TIMEOUT:g}\nheartbeat = 0.5\n"
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


class AgentData:
    """verl's trajectory state, as much of it as the tool reads: it keys its sandbox on it."""

    def __init__(self) -> None:

        self.request_id = uuid.uuid4().hex


class VerlWorker:
    """One verl agent-loop worker: the tools built from the docs' YAML when it starts."""

    def __init__(self) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from verl.tools.tool_registry import initialize_tools_from_config

        # What AgentLoopWorker does at start: a bad tangram setup raises here.
        self.tools = initialize_tools_from_config(str(DOCS / "verl_tools.yaml"))

    async def rollout(self, code: str, trajectories: int, tokenizer_dir: str) -> list[str]:
        """``trajectories`` runs of verl's own ``ToolAgentLoop`` at once, each asking the
        sandbox tool to run ``code`` once; the tool's outputs, as the model saw them.

        The LLM server is the one stand-in (vLLM needs a GPU): it answers the first turn
        with the tool call and the second with a final message, as real token ids.
        """
        import json
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from _tiny import ROLLOUT, tiny_tokenizer
            from omegaconf import OmegaConf
            from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
            from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
            from verl.workers.rollout.replica import TokenOutput

        tokenizer = tiny_tokenizer(Path(tokenizer_dir) / uuid.uuid4().hex)
        call = json.dumps({"name": "run_python", "arguments": {"code": code}})
        seen: list[str] = []

        class Server:
            def __init__(self) -> None:
                self.turns = [f"<tool_call>{call}</tool_call><|im_end|>", "done<|im_end|>"]

            async def generate(self, request_id: str, prompt_ids: list[int], **_: Any) -> Any:
                if len(self.turns) == 1:  # the second turn: the tool's output is in it
                    seen.append(tokenizer.decode(prompt_ids))
                text = self.turns.pop(0)
                return TokenOutput(token_ids=tokenizer.encode(text, add_special_tokens=False))

        rollout = {**ROLLOUT, "multi_turn": {**ROLLOUT["multi_turn"], "max_parallel_calls": 1}}
        config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}, "data": {}})

        async def one() -> None:
            loop = ToolAgentLoop(
                trainer_config=DictConfigWrap(config),
                server_manager=Server(),
                tokenizer=tokenizer,
                processor=None,
                dataset_cls=None,
                data_config=DictConfigWrap(config.data),
                tools=ToolListWrap(self.tools),
            )
            await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "go"}])

        await asyncio.gather(*(one() for _ in range(trajectories)))
        return seen

    async def call(self, code: str) -> str:
        """``ToolAgentLoop._call_tool``'s sequence for one call of the sandbox tool."""

        tool = self.tools[0]
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            response, _, _ = await tool.execute(instance_id, {"code": code}, agent_data=AgentData())
        finally:
            await tool.release(instance_id)
        return str(response.text)


class SessionWorker:
    """A worker that uses the adapters' session directly (sandboxes, GPU services)."""

    async def sandbox_calls(self, code: str, n: int) -> list[tuple[str, str]]:
        from tangram._frameworks import _session

        async def one() -> tuple[str, str]:
            async with (
                _session.session() as resources,
                resources.sandbox_pool().sandbox(f"probe-{id(object())}-{time.time()}") as sandbox,
            ):
                result = await sandbox.run(code=code, cpu=1)
                return sandbox.host, result.stdout.decode()

        return list(await asyncio.gather(*(one() for _ in range(n))))

    async def group_sample(self, key: str, arrive_at: float, wait: float) -> tuple[float, float]:
        """One sample of group ``key`` in the job's gate, arriving at wall time
        ``arrive_at``: when it arrived and when its group let it go."""
        from tangram._frameworks import _session

        async with _session.session() as resources, resources.group(key, wait) as arrive:
            await asyncio.sleep(max(0.0, arrive_at - time.time()))
            arrived = time.time()
            await arrive()
            return arrived, time.time()

    async def judge(self, n: int) -> list[list[float]]:
        from tangram._frameworks import _session

        async def one(i: int) -> list[float]:
            async with (
                _session.session() as resources,
                resources.gpu_pool().use("judge") as judge,
            ):
                out = await judge(torch.full((1, 4), float(i)))
                return [float(x) for x in out[0]]

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def build_judge() -> Any:
    """The judge's factory; each call (one per load) leaves a line in ``$JUDGE_LOADS``."""
    with open(os.environ["JUDGE_LOADS"], "a") as loads:
        loads.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


class OpenRLHFWorker:
    """One vLLM engine actor's agent side: OpenRLHF's executor, built as its actor does."""

    def __init__(self, tokenizer_dir: str) -> None:
        import importlib.util
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import tangram_openrlhf.agent as agent_module
            from transformers import AutoTokenizer

        spec = importlib.util.spec_from_file_location("agent_module", agent_module.__file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.executor = module.AgentExecutor()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    async def episodes(self, turns: list[str], n: int) -> list[tuple[float, list[str]]]:
        from types import SimpleNamespace

        tokenizer = self.tokenizer

        class Engine:  # stand-in for the vLLM engine: fixed turns as real token ids
            def __init__(self) -> None:
                self.turns = list(turns)
                self.prompts: list[str] = []

            async def generate(self, prompt_ids: list[int], params: Any, **_: Any) -> Any:
                self.prompts.append(tokenizer.decode(prompt_ids))
                text = self.turns.pop(0)
                ids = tokenizer.encode(text, add_special_tokens=False)
                out = SimpleNamespace(token_ids=ids, text=text, finish_reason="stop", logprobs=None)
                return SimpleNamespace(outputs=[out])

        async def one() -> tuple[float, list[str]]:
            engine = Engine()
            params = SimpleNamespace(max_tokens=None, logprobs=None)
            result = await self.executor.execute(
                "Probe.", "assert answer() == 42", params, 8192, tokenizer, engine
            )
            return float(result["reward"]), engine.prompts[1:]

        return list(await asyncio.gather(*(one() for _ in range(n))))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("shared")
    nodes = ray.cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    try:
        other = nodes.add_node(num_cpus=1, resources={"node_b": 1})
        config = _config(tmp, "tangram.toml")
        env = {
            "TANGRAM_CONFIG": str(config),
            # The tests and their helpers (tests/_probes.py), for factories the agents load.
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).parent), str(Path(__file__).parents[1]), str(ROOT)]
            ),
        }
        ray.init(address=nodes.address, log_to_driver=False, runtime_env={"env_vars": env})
        nodes.wait_for_nodes()
        yield {
            "cluster": nodes,
            "tmp": tmp,
            "env": env,
            "head": ray.get_runtime_context().get_node_id(),
            "other": other.node_id,
        }
    finally:
        ray.shutdown()
        nodes.shutdown()


def _on(node: str) -> dict[str, Any]:
    return {
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    }


def _scheduler_stats(resource: str | None = None) -> Any:
    """The job's scheduler, read through a proxy of the driver's own."""

    async def read() -> Any:
        actor = ray.get_actor(scheduler_name(_job()), namespace=NAMESPACE)
        async with attach(actor) as remote:
            return await remote.stats(), await actor.hosts.remote()

    return asyncio.run(read())


def _job() -> str:
    return str(ray.get_runtime_context().get_job_id())


def test_a_missing_config_fails_the_worker_at_start(cluster: dict[str, Any]) -> None:
    env = {**cluster["env"], "TANGRAM_CONFIG": str(cluster["tmp"] / "absent.toml")}
    worker = ray.remote(VerlWorker).options(runtime_env={"env_vars": env}).remote()
    with pytest.raises(ray.exceptions.RayActorError) as caught:
        ray.get(worker.call.remote("print(1)"), timeout=180)
    assert "ConfigError" in str(caught.value)
    assert "absent.toml" in str(caught.value)


@pytest.fixture(scope="module")
def verl_workers(cluster: dict[str, Any]) -> list[Any]:
    """Four verl workers on the head node (importing verl takes long: the module shares them)."""
    return [ray.remote(VerlWorker).options(**_on(cluster["head"])).remote() for _ in range(4)]


def test_four_verl_workers_share_the_hosts_cores(
    cluster: dict[str, Any], verl_workers: list[Any]
) -> None:
    """Four agent-loop worker processes, each running verl's ``ToolAgentLoop`` on two
    trajectories at once, with the docs' own tool YAML and config."""
    workers = verl_workers
    code = PROBE.format(seconds=0.4)
    tok = str(cluster["tmp"] / "tok")
    outputs = ray.get([w.rollout.remote(code, 2, tok) for w in workers], timeout=300)
    found = probes([text for per_worker in outputs for text in per_worker])
    assert len(found) == 8
    assert_never_shared(found, cores=os.cpu_count() or 1)
    assert all(len(cores) == 1 for _, _, cores in found)  # the docs' cpu: 1
    stats, hosts = _scheduler_stats()
    # One agent on the workers' node, its cores counted there and back to idle.
    (name,) = hosts
    assert name == host_name(cluster["head"])
    assert hosts[name]["units"] == os.cpu_count()
    assert stats.resources[f"cpu@{name}"].held == 0


def test_a_worker_the_jobs_scheduler_refuses_fails_at_start(
    cluster: dict[str, Any], verl_workers: list[Any]
) -> None:
    """A worker whose config states another capacity than the job's scheduler (a file
    edited on one node) fails where verl builds its tools, not at its first call."""
    assert "ok" in ray.get(verl_workers[1].call.remote("print('ok')"), timeout=180)
    edited = cluster["tmp"] / "edited"  # the job's own file stays as it is
    edited.mkdir()
    config = _config(edited, "tangram.toml", {"search_conn = 4": "search_conn = 8"})
    env = {**cluster["env"], "TANGRAM_CONFIG": str(config)}
    worker = ray.remote(VerlWorker).options(runtime_env={"env_vars": env}).remote()
    with pytest.raises(ray.exceptions.RayActorError) as caught:
        ray.get(worker.call.remote("print(1)"), timeout=180)
    assert "ConfigError" in str(caught.value)
    assert "every worker must read the same config" in str(caught.value)


def test_two_openrlhf_engine_actors_share_the_hosts_cores(cluster: dict[str, Any]) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from _tiny import tiny_tokenizer

    tokenizer_dir = cluster["tmp"] / "tok"
    tiny_tokenizer(tokenizer_dir)
    config = _config(cluster["tmp"], "openrlhf.toml")
    env = {**cluster["env"], "TANGRAM_CONFIG": str(config)}
    call = '<tool_call>{"name": "run_code", "arguments": {"code": %s}}</tool_call>'
    import json

    # The last turn is the answer the grader scores against the label's assertion.
    turns = [
        call % json.dumps(PROBE.format(seconds=0.3)),
        "Done.\n```python\ndef answer():\n    return 42\n```",
    ]
    workers = [
        ray.remote(OpenRLHFWorker)
        .options(**_on(cluster["head"]), runtime_env={"env_vars": env})
        .remote(str(tokenizer_dir))
        for _ in range(2)
    ]
    results = ray.get([w.episodes.remote(turns, 3) for w in workers], timeout=300)
    episodes = [episode for per_worker in results for episode in per_worker]
    assert [reward for reward, _ in episodes] == [1.0] * 6
    found = probes([feedback[0] for _, feedback in episodes])
    assert_never_shared(found, cores=os.cpu_count() or 1)
    for worker in workers:
        ray.kill(worker)


def test_two_nodes_each_count_their_own_cores(cluster: dict[str, Any]) -> None:
    head, other = cluster["head"], cluster["other"]
    workers = [ray.remote(SessionWorker).options(**_on(node)).remote() for node in (head, other)]
    outputs = ray.get(
        [w.sandbox_calls.remote(PROBE.format(seconds=0.5), 4) for w in workers], timeout=300
    )
    calls = [call for per_worker in outputs for call in per_worker]
    stats, hosts = _scheduler_stats()
    names = {host_name(head), host_name(other)}
    assert set(hosts) == names
    # Each node registered its own cores; the cluster's capacity is their sum.
    per_node = {name: stats.resources[f"cpu@{name}"].total for name in names}
    assert per_node == {name: float(hosts[name]["units"]) for name in names}
    assert sum(per_node.values()) == 2 * (os.cpu_count() or 1)
    used = {host for host, _ in calls}
    assert used == names  # eight sandboxes open at once spread over both hosts
    for name in names:
        found = probes([text for host, text in calls if host == name])
        assert_never_shared(found, cores=int(per_node[name]))
    for worker in workers:
        ray.kill(worker)


def test_a_killed_worker_gives_its_cores_back(
    cluster: dict[str, Any], verl_workers: list[Any]
) -> None:
    worker = verl_workers[0]
    # Longer than the tool's timeout (the docs' YAML: 20 s): only the reclaim frees it.
    pending = worker.call.remote("import time; time.sleep(60)")

    def held() -> float:
        # Every node's cores: once the two-node test has started the second node's agent,
        # the worker's sandbox may be placed on either node.
        stats, _ = _scheduler_stats()
        cores = [r for key, r in stats.resources.items() if key.startswith("cpu@")]
        return float(sum(r.held for r in cores))

    deadline = time.monotonic() + 90
    while held() < 1:
        assert time.monotonic() < deadline, "the call never started"
        done, _ = ray.wait([pending], timeout=0)
        assert not done, f"the call ended before it was killed: {ray.get(done[0])!r}"
        time.sleep(0.2)
    ray.kill(worker)
    killed = time.monotonic()
    while held() > 0:
        assert time.monotonic() - killed < 3 * LEASE_TIMEOUT, "the cores never came back"
        time.sleep(0.2)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pending, timeout=30)


def test_a_groups_samples_in_two_workers_wait_for_each_other(cluster: dict[str, Any]) -> None:
    """The group reward's gate is the job's in shared mode: samples of one prompt that
    verl sent to two reward workers go together; a sample alone goes at once."""
    workers = [ray.remote(SessionWorker).options(**_on(cluster["head"])).remote() for _ in range(2)]
    # Both workers' sessions up first, so that both samples are in the gate in time.
    ray.get([w.group_sample.remote(f"warm-{i}", 0.0, 5.0) for i, w in enumerate(workers)])
    start = time.time()
    early, late = ray.get(
        [
            workers[0].group_sample.remote("prompt-1", start + 1.0, 30.0),
            workers[1].group_sample.remote("prompt-1", start + 2.5, 30.0),
        ],
        timeout=120,
    )
    # The early one waited for the late one's arrival, and went with it.
    assert early[1] >= late[0] - 0.05, (early, late)
    assert early[1] - late[0] < 1.5 and late[1] - late[0] < 1.5
    alone = ray.get(workers[0].group_sample.remote("prompt-2", time.time(), 30.0), timeout=60)
    assert alone[1] - alone[0] < 1.5


def test_a_killed_workers_sample_holds_its_group_no_longer(cluster: dict[str, Any]) -> None:
    """A reward worker killed with a sample in the job's gate: once the scheduler drops
    its proxy (a lease timeout), the group goes without it, long before ``group_wait``."""
    waiting, doomed = (
        ray.remote(SessionWorker).options(**_on(cluster["head"])).remote() for _ in range(2)
    )
    ray.get([w.group_sample.remote("warm", 0.0, 5.0) for w in (waiting, doomed)])
    start = time.time()
    pending = waiting.group_sample.remote("prompt-3", start + 1.0, 120.0)
    doomed.group_sample.remote("prompt-3", start + 3600.0, 120.0)
    time.sleep(2.0)
    ray.kill(doomed, no_restart=True)
    arrived, released = ray.get(pending, timeout=90)
    assert released - arrived < 4 * LEASE_TIMEOUT, (arrived, released)


def test_no_tangram_actor_outlives_the_job(cluster: dict[str, Any]) -> None:
    job = _job()
    ours = {
        scheduler_name(job),
        agent_name(job, cluster["head"]),
        agent_name(job, cluster["other"]),
    }
    assert ours <= {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    ray.shutdown()  # the driver ends: the job's workers go with it
    ray.init(address=cluster["cluster"].address, log_to_driver=False)
    started = time.monotonic()
    while ours & {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}:
        # The scheduler waits out the workers' lease timeout, then its own idle time.
        assert time.monotonic() - started < 8 * LEASE_TIMEOUT + 30, "tangram actors stayed"
        time.sleep(0.5)


def test_reward_workers_on_a_node_share_one_judge(cluster: dict[str, Any]) -> None:
    loads = cluster["tmp"] / "loads.txt"
    config = cluster["tmp"] / "judge.toml"
    config.write_text(
        '[gpu]\ndevices = { "cpu:0" = "1MiB" }\n[[gpu.services]]\nname = "judge"\n'
        'factory = "test_shared_ray:build_judge"\n'
        f"[ray]\nlease_timeout = {LEASE_TIMEOUT:g}\nheartbeat = 0.5\n"
    )
    env = {**cluster["env"], "TANGRAM_CONFIG": str(config), "JUDGE_LOADS": str(loads)}
    ray.shutdown()  # a new job of its own: this config's scheduler, not the last test's
    ray.init(address=cluster["cluster"].address, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        workers = [
            ray.remote(SessionWorker).options(**_on(cluster["head"])).remote() for _ in range(3)
        ]
        scores = ray.get([w.judge.remote(3) for w in workers], timeout=300)
        torch.manual_seed(0)
        reference = torch.nn.Linear(4, 2)
        for per_worker in scores:
            for i, row in enumerate(per_worker):
                expected = reference(torch.full((1, 4), float(i)))[0].tolist()
                assert row == pytest.approx(expected)
        # Nine calls from three processes: one copy of the judge, loaded on the node's agent.
        assert len(loads.read_text().split()) == 1
        agent = ray.get_actor(agent_name(_job(), cluster["head"]), namespace=NAMESPACE)
        stats = ray.get(agent.service_stats.remote())["judge"]
        assert stats["batched"] == 9  # every call ran on that one copy
        for worker in workers:
            ray.kill(worker)
    finally:
        ray.shutdown()
        ray.init(address=cluster["cluster"].address, log_to_driver=False)
