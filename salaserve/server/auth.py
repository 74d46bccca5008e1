"""Who may call what: the API key on every route but the probes, the admin key, and request owners.

- `--api-key KEY`: `Authorization: Bearer KEY` is required on every route except /health and
  /ping (and /metrics with --metrics-no-auth). /health_generate needs it: it runs a model step.
- `--admin-api-key KEY`: also accepted wherever the API key is; it alone may abort other clients'
  requests and use `abort_all`.
- Owners: a request belongs to the client address and the credential that started it, so that
  /abort_request stops only the caller's own requests. The address is part of it because one
  --api-key is usually shared by every client; the credential, so that clients behind one address
  with different keys (the admin's among them) stay apart.
"""

from __future__ import annotations

import hashlib
import hmac

from salaserve.server.protocol import error_response

# Liveness probes answer without a key, as in SGLang (exact paths: /health_generate is not one).
OPEN_PATHS = frozenset({"/health", "/ping"})


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def authorization(scope) -> bytes:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value
    return b""


def is_admin(scope, admin_api_key: str | None) -> bool:
    return admin_api_key is not None and hmac.compare_digest(authorization(scope), bearer(admin_api_key))


def request_owner(scope) -> str:
    """The owner of the requests this HTTP request starts: client address + a digest of its
    credential (the key itself is never kept)."""
    host = (scope.get("client") or ("?", 0))[0]
    credential = hashlib.sha256(authorization(scope)).hexdigest()[:16]
    return f"{host}/{credential}"


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <api key or admin key>`, on every route but the open ones."""

    def __init__(self, app, api_key: str | None, admin_api_key: str | None = None, metrics_no_auth: bool = False):
        self.app = app
        self.accepted = [bearer(k) for k in (api_key, admin_api_key) if k]
        self.open_paths = OPEN_PATHS | ({"/metrics"} if metrics_no_auth else set())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = authorization(scope)
        # compare against every key (no early exit), in constant time
        if not sum(hmac.compare_digest(given, key) for key in self.accepted):
            response = error_response(scope["path"], 401, "Unauthorized: a valid 'Authorization: Bearer <api key>' "
                                                          "header is required")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)
