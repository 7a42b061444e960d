"""The playground page and its static files (service/api/static/)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

from service.engine.errors import NotFound

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
STATIC_TYPES = {
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}

router = APIRouter(tags=["ui"])


@router.get("/", name="index", response_class=HTMLResponse, include_in_schema=False)
async def index() -> HTMLResponse:
    return HTMLResponse((STATIC_DIR / "index.html").read_text(encoding="utf-8"))


@router.get("/static/{name}", name="static", include_in_schema=False)
async def static(name: str) -> FileResponse:
    """A file of service/api/static/ by its plain name (no folders, no dotfiles, known types only)."""
    path = STATIC_DIR / name
    if name.startswith(".") or path.suffix not in STATIC_TYPES or not path.is_file():
        raise NotFound(f"no static file {name!r}")
    return FileResponse(path, media_type=STATIC_TYPES[path.suffix])
