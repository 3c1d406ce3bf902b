"""The stand-in's keys, as SGLang checks them: which key each route wants comes from the
endpoint table (``backends.sglang.api``); this module decides whether a request's
``Authorization`` header carries it, and answers 401 before the request reaches a route."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from rollout_lifecycle.backends.http.rows import Auth
from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.backends.sglang.api import auth_level

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send


def token_matches(authorization: str | None, expected: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <expected>``, nothing else (no
    ``X-API-Key``, no other scheme); compared in constant time. Both stand-ins' key checks use
    it."""
    # sglang: utils/auth.py decide_request_auth._check_bearer_token
    if not authorization:
        return False
    scheme, sep, token = authorization.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return False
    # Starlette decodes header bytes as latin-1; re-encoding gives back the wire bytes.
    return hmac.compare_digest(token.encode("latin-1", "replace"), expected.encode("utf-8"))


def request_allowed(
    path: str,
    authorization: str | None,
    *,
    api_key: str | Secret | None,
    admin_key: str | Secret | None,
) -> bool:
    """SGLang's decision: may a request to ``path`` with this ``Authorization`` header pass?
    (401 ``{"error": "Unauthorized"}`` if not)."""
    # sglang: utils/auth.py decide_request_auth (ADMIN_OPTIONAL and NORMAL levels)
    level = auth_level(path)
    api = as_secret(api_key, what="api_key")
    admin = as_secret(admin_key, what="admin_key")
    if level is Auth.OPEN:
        return True
    # Control: the admin key when one is configured (the api key is then refused), else the api
    # key. Normal: the api key, even when an admin key exists.
    key = (admin or api) if level is Auth.CONTROL else api
    return key is None or token_matches(authorization, key.reveal())


class AuthMiddleware:
    """Pure ASGI middleware (keeps client-disconnect events intact, as SGLang's does)."""

    def __init__(self, app: ASGIApp, *, api_key: Secret | None, admin_key: Secret | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        headers = Headers(scope=scope)
        if not request_allowed(
            scope["path"],
            headers.get("authorization"),
            api_key=self.api_key,
            admin_key=self.admin_key,
        ):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


__all__ = ["AuthMiddleware", "request_allowed", "token_matches"]
