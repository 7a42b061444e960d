"""Optional Bearer API keys: user keys for every /v1 route, admin keys also for adapter load/unload.

With no keys configured the API is open. Keys are compared in constant time against every
configured key (no early exit), and neither the header nor a key is ever logged. /health, /ready,
/metrics and / are not behind auth: probes and scrapers carry no keys.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.deps import get_settings
from service.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="An API key (TSERVE_API_KEYS or TSERVE_ADMIN_KEYS).")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _matches(given: str, keys: tuple[str, ...]) -> bool:
    candidate = given.encode("utf-8", "surrogateescape")
    found = False
    for key in keys:  # every key, every time: no timing hint of which (or whether one) matched
        found |= hmac.compare_digest(candidate, key.encode())
    return found


def _role(credentials: HTTPAuthorizationCredentials | None, settings: Settings) -> str:
    """'admin', 'user' or 'open' (no keys configured); raises 401 for a missing or unknown key."""
    if not settings.auth_enabled:
        return "open"
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise HTTPException(401, "an API key is required: send 'Authorization: Bearer <key>'", headers=_CHALLENGE)
    given = credentials.credentials
    is_admin = _matches(given, settings.admin_keys)
    is_user = _matches(given, settings.api_keys)
    if is_admin:
        return "admin"
    if is_user:
        return "user"
    raise HTTPException(401, "invalid API key", headers=_CHALLENGE)


def require_key(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    settings: Annotated[Settings, Depends(get_settings)],
) -> str:
    """Dependency of every /v1 route; returns the caller's role."""
    return _role(credentials, settings)


def client_key(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    role: Annotated[str, Depends(require_key)],
) -> str | None:
    """Who is asking, for the per-key queue cap: a digest of the caller's (checked) key; None with auth off."""
    if role == "open":
        return None
    return hashlib.sha256(credentials.credentials.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def require_admin(role: Annotated[str, Depends(require_key)]) -> None:
    """Dependency of adapter load/unload."""
    if role not in ("admin", "open"):
        raise HTTPException(403, "loading and unloading adapters needs an admin key")
