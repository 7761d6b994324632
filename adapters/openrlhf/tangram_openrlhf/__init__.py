"""tangram for OpenRLHF: an agent executor and a reward function, both loaded by file path.

Importing this package imports OpenRLHF; ``import tangram`` does not. See docs/openrlhf.md
for the flags and the configuration.
"""

from tangram_openrlhf.agent import AgentExecutor as AgentExecutor
from tangram_openrlhf.agent import AgentInstance as AgentInstance
from tangram_openrlhf.reward import reward_func as reward_func

__all__ = ["AgentExecutor", "AgentInstance", "reward_func"]
