"""The server token: what stops anyone who reaches a server-mode vLLM server from pushing weights into it.

`trl-roundalign serve` runs vLLM with its development endpoints on
(``VLLM_SERVER_DEV_MODE=1``: `/init_weight_transfer_engine`, `/update_weights`, `/collective_rpc`, `/sleep`,
`/server_info`, ...). vLLM's ``--api-key`` guards only its inference routes (``/v1``, ``/v2``, ``/inference``,
``/cohere``); without more, any process that reaches the port could point the server at its own gloo store and
load weights of its choosing, which the trainer would then sample from. `ServerTokenMiddleware` (installed by
`serve` through vLLM's ``--middleware`` option, so every API-server process has it) requires the token in the
`TOKEN_HEADER` header on every request whose path is not on `PUBLIC_PATHS` / `PUBLIC_PREFIXES`: every dev-mode
endpoint, the runtime LoRA routes, and any other route vLLM adds later, is refused without it (401; 403 with a wrong
one). The token comes
from the `TOKEN_ENV` environment variable, in the server's and in the trainer's environment alike;
`GlooVLLMClient` sends it with every request.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets

TOKEN_ENV = "ROUNDALIGN_SERVER_TOKEN"
TOKEN_HEADER = "X-RoundAlign-Token"

# Reachable without the token, by exact path only: liveness and version probes, metrics, the model list, and the
# inference routes TRL's vLLM client generates with (`/v1/completions`, `/v1/chat/completions` and its `/render`,
# `/inference/v1/generate`; vLLM's own --api-key guards `/v1` and `/inference` when one is set). Everything else
# needs the token, `/v1/` routes included: `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
# (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) change what the server samples from, `/v1/responses/{id}/cancel` stops
# another client's request, and a route vLLM adds later is refused until it is named here.
PUBLIC_PATHS = frozenset({
    "/health", "/ping", "/version", "/load", "/metrics",
    "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/render", "/inference/v1/generate",
})  # fmt: skip
PUBLIC_PREFIXES = ("/metrics/",)

__all__ = ["PUBLIC_PATHS", "PUBLIC_PREFIXES", "TOKEN_ENV", "TOKEN_HEADER", "ServerTokenMiddleware", "is_loopback", "new_token"]


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8")).digest()


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


class ServerTokenMiddleware:
    """Pure ASGI middleware: the token in `TOKEN_HEADER` on every non-public request, else 401 (none) or 403 (wrong).

    A server whose environment has no token refuses every guarded request rather than serving them unchecked.
    """

    def __init__(self, app, token: str | None = None) -> None:
        self.app = app
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self._digest = _digest(token) if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if is_public(path):
            return await self.app(scope, receive, send)
        given = None
        header = TOKEN_HEADER.lower().encode("latin-1")
        for name, value in scope.get("headers") or ():
            if name.lower() == header:
                given = value.decode("latin-1")
                break
        if given is None:
            status, why = 401, f"this endpoint needs the server token in the {TOKEN_HEADER} header ({TOKEN_ENV})"
        elif self._digest is None:
            status, why = 403, f"the server has no token ({TOKEN_ENV} unset in its environment): refused"
        elif not secrets.compare_digest(_digest(given), self._digest):
            status, why = 403, f"wrong server token ({TOKEN_HEADER}); the trainer's {TOKEN_ENV} must be the server's"
        else:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": why})
        from starlette.responses import JSONResponse

        return await JSONResponse({"error": why}, status_code=status)(scope, receive, send)
