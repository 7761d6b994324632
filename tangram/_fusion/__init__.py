"""SandboxFusion's HTTP API served from tangram's sandbox pool (``tangram serve-sandbox-fusion``).

A server beside the adapters, not part of them: verl reaches it by URL alone, so it needs
no adapter, and it builds on the same per-loop session the adapters use. It sits above
:mod:`tangram._frameworks` (whose session it opens) and below the CLI that starts it.
"""

from ._server import DEFAULT_PORT as DEFAULT_PORT
from ._server import LANGUAGES as LANGUAGES
from ._server import RequestError as RequestError
from ._server import run_code as run_code
from ._server import serve as serve
