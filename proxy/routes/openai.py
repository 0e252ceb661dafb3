"""OpenAI-compatible routes: chat completions, completions, model list."""

from __future__ import annotations

import time

from fastapi import APIRouter
from starlette.routing import Route

from proxy.asgi import ROUTES, RouteEndpoint
from proxy.deps import KeyDep, StateDep

router = APIRouter()

# The completion paths are served by proxy.asgi before FastAPI sees the request
# (GatewayApp); these registrations answer a wrong method with 405, serve an app
# mounted under a root_path with the same handler, and are documented by
# proxy.asgi.completion_openapi.
for _path in ROUTES:
    router.routes.append(Route(_path, RouteEndpoint(_path), methods=["POST"],
                               include_in_schema=False))


@router.get("/v1/models")
async def list_models(state: StateDep, identity: KeyDep) -> dict[str, object]:
    """The models this gateway serves."""
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "kvtoll"}
            for m in state.models
        ],
    }
