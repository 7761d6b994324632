"""A plain verl tool with no tangram in it, for :class:`tangram_verl.tools.TangramTool` to wrap.

It stands for the tools projects already have (a web search behind an API key): it knows
nothing of quotas, and the wrapper puts it under one from the YAML alone.
"""

from __future__ import annotations

from typing import Any

import httpx
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["HttpSearchTool"]


class HttpSearchTool(BaseTool):
    """``GET {url}?q=<query>``; the response body is the observation.

    ``config`` keys: ``url``, ``timeout`` (seconds, default 10), ``headers``.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        super().__init__(config, tool_schema)
        self.url: str = config["url"]
        self.timeout = float(config.get("timeout", 10))
        self.headers: dict[str, str] = dict(config.get("headers", {}))

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            response = await client.get(self.url, params={"q": str(parameters.get("query", ""))})
        text = response.text if response.is_success else f"HTTP {response.status_code}"
        return ToolResponse(text=text), 0.0, {"status": response.status_code}
