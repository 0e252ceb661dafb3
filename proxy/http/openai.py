"""OpenAI-compatible routes besides the completions (:mod:`proxy.http.completions`):
the model list."""

from __future__ import annotations

import time

from fastapi import APIRouter

from proxy.deps import KeyDep, StateDep

router = APIRouter()


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
