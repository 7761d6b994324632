"""tangram for verl: tools, function tools and rewards that verl loads by path.

Importing this package imports verl; ``import tangram`` does not.
See docs/verl.md for the configuration.
"""

from tangram_verl.reward import TangramRewardManager as TangramRewardManager
from tangram_verl.reward import compute_score as compute_score
from tangram_verl.tools import SandboxTool as SandboxTool
from tangram_verl.tools import TangramTool as TangramTool
from tangram_verl.tools import run_code as run_code
from tangram_verl.tools import with_tangram as with_tangram

__all__ = [
    "SandboxTool",
    "TangramRewardManager",
    "TangramTool",
    "compute_score",
    "run_code",
    "with_tangram",
]
