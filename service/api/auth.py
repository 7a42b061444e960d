"""Optional Bearer API keys: user keys for every /v1 route, admin keys also for model and adapter load/unload.

With no keys configured the API is open. Keys are compared in constant time against every
configured key (no early exit), and neither the header nor a key is ever logged. /health, /ready,
/metrics and / are not behind auth: probes and scrapers carry no keys.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from service.api.deps import get_settings
from service.engine.errors import InvalidRequest
from service.engine.types import QueueTag
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


def role_of(authorization: str | None, settings: Settings) -> str:
    """:func:`_role` of a raw ``Authorization`` header, read as ``HTTPBearer`` reads it (for middleware that
    answers before a route runs)."""
    scheme, key = get_authorization_scheme_param(authorization)
    bearer = bool(authorization and scheme and key) and scheme.lower() == "bearer"
    return _role(HTTPAuthorizationCredentials(scheme=scheme, credentials=key) if bearer else None, settings)


def require_key(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    settings: Annotated[Settings, Depends(get_settings)],
) -> str:
    """Dependency of every /v1 route; returns the caller's role."""
    return _role(credentials, settings)


@dataclass(frozen=True)
class Caller:
    """Who is asking, for the queue: a digest of the caller's key (None with auth off: one tenant) and the lowest
    priority value it may ask for (None: any; a user key's is ``min_user_priority``)."""

    client: str | None = None
    min_priority: int | None = None

    def queue(self, priority: int) -> QueueTag:
        """Where this caller's request at ``priority`` waits; InvalidRequest (422) below what its key may ask for."""
        if self.min_priority is not None and priority < self.min_priority:
            raise InvalidRequest("priority", f"{priority} is below {self.min_priority}, the lowest a user API key may "
                                 f"ask for (min_user_priority={self.min_priority}, TSERVE_MIN_USER_PRIORITY); "
                                 "admin keys may use any")
        return QueueTag(priority, self.client)


def caller(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    role: Annotated[str, Depends(require_key)],
    settings: Annotated[Settings, Depends(get_settings)],
) -> Caller:
    """Dependency of the routes that queue work: the per-key cap and fair share count the key's digest."""
    if role == "open":
        return Caller()
    digest = hashlib.sha256(credentials.credentials.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return Caller(digest, None if role == "admin" else settings.min_user_priority)


def require_admin(role: Annotated[str, Depends(require_key)]) -> None:
    """Dependency of model and adapter load/unload."""
    if role not in ("admin", "open"):
        raise HTTPException(403, "loading and unloading models and adapters needs an admin key")
