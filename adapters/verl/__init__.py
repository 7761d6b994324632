"""tangram for verl: tools, function tools and rewards that verl loads by path.

Importing this package imports verl; ``import tangram`` and ``import adapters`` do not.
See docs/verl.md for the configuration.
"""

from adapters.verl.reward import TangramRewardManager as TangramRewardManager
from adapters.verl.reward import compute_score as compute_score
from adapters.verl.tools import SandboxTool as SandboxTool
from adapters.verl.tools import TangramTool as TangramTool
from adapters.verl.tools import run_code as run_code
from adapters.verl.tools import with_tangram as with_tangram

__all__ = [
    "SandboxTool",
    "TangramRewardManager",
    "TangramTool",
    "compute_score",
    "run_code",
    "with_tangram",
]
