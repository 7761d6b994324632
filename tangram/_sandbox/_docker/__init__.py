"""The Docker backend: one container per sandbox, driven over the Engine API.

Everything here serves :class:`DockerBackend`; the runner (:mod:`._runner`) is the program
each container runs as its main process, so it imports nothing of tangram.
"""

from ._backend import DockerBackend as DockerBackend
from ._engine import DockerConfig as DockerConfig
