"""tangram for OpenRLHF: an agent executor and a reward function, both loaded by file path.

Importing this package imports OpenRLHF; ``import tangram`` and ``import adapters`` do
not. See docs/openrlhf.md for the flags and the configuration.
"""

from adapters.openrlhf.agent import AgentExecutor as AgentExecutor
from adapters.openrlhf.agent import AgentInstance as AgentInstance
from adapters.openrlhf.reward import reward_func as reward_func

__all__ = ["AgentExecutor", "AgentInstance", "reward_func"]
