"""A real Hugging Face tokenizer small enough to build in a test (no hub access here).

Byte-level BPE with no merges: every byte is a token, so any text round-trips, plus the
special tokens and a chat template in the Qwen style verl's hermes tool parser reads.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>"
    '{{ {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}'
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """Build, save under ``directory`` (for code that loads by path) and return it."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(directory)
    return fast


def build_judge() -> Any:
    """A real torch reward model: scores 1 when the answer contains the ground truth."""
    import torch

    judge = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        judge.weight.copy_(torch.tensor([[0.0, 1.0]]))
    return judge


def encode(solution_str: str, ground_truth: Any, **info: Any) -> Any:
    """One input row for the judge: [answer length, whether it contains the truth]."""
    import torch

    return torch.tensor([[float(len(solution_str)), float(str(ground_truth) in solution_str)]])


async def ask_judge(client: Any, solution_str: str, ground_truth: Any, **info: Any) -> float:
    """An LLM-judge call: any answer the (loopback) provider accepts scores by a rule."""
    response = await client.post("/judge", json={"answer": solution_str})
    response.raise_for_status()
    return float(str(ground_truth) in solution_str)


#: ``actor_rollout_ref.rollout`` for verl's ``ToolAgentLoop`` in the tests: hermes tool
#: calls, a few turns.
ROLLOUT = {
    "prompt_length": 2048,
    "response_length": 2048,
    "full_determinism": False,
    "multi_turn": {
        "max_user_turns": 4,
        "max_assistant_turns": 4,
        "max_parallel_calls": 2,
        "max_tool_response_length": 1024,
        "tool_response_truncate_side": "middle",
        "format": "hermes",
    },
}


DOCS_EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def per_process(name: str) -> Path:
    """The docs' example config ``name`` with ``mode = "local"`` put first.

    For tests that read this process's own runtime and pools (or break them) under the
    frameworks' code: in the docs' default shared mode the job's scheduler is another
    process (tests/test_node.py, and tests/adapters/test_shared_ray.py on Ray).
    """
    folder = Path(tempfile.gettempdir()) / f"tangram-local-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text('mode = "local"\n' + (DOCS_EXAMPLES / name).read_text())
    return path
