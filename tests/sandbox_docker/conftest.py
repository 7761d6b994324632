"""Fixtures of the Docker sandbox tests: asyncio only, a usable daemon, a pool on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .docker_support import Setup, ensure_docker, open_pool


@pytest.fixture
def anyio_backend() -> str:
    # aiodocker is built on aiohttp, which runs on asyncio only.
    return "asyncio"


@pytest.fixture
async def docker() -> None:
    await ensure_docker()


@pytest.fixture
async def setup(docker: None) -> AsyncIterator[Setup]:
    async with open_pool() as value:
        yield value
