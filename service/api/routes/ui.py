"""The pages for people: the playground (service/api/static/) and the API docs (/docs, /redoc), with every
file they load served from here, so that they work where the server cannot reach the internet."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from service.engine.errors import NotFound

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# Swagger UI, ReDoc and FastAPI's favicon as the pinned fastapi-offline package ships them (FastAPI's own
# /docs and /redoc load them from a CDN; app.py turns those off).
DOCS_ASSETS_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"
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
    """A file of service/api/static/ by its plain name."""
    return _files(name, STATIC_DIR)


def _files(name: str, folder: Path) -> FileResponse:
    """A file of ``folder`` by its plain name (no folders, no dotfiles, known types only)."""
    path = folder / name
    if name.startswith(".") or path.suffix not in STATIC_TYPES or not path.is_file():
        raise NotFound(f"no static file {name!r}")
    return FileResponse(path, media_type=STATIC_TYPES[path.suffix])


def _docs_urls(request: Request) -> tuple[str, str]:
    """(the OpenAPI document's URL, the docs assets' folder URL), under the root path a proxy may add."""
    root = request.scope.get("root_path", "").rstrip("/")
    return f"{root}{request.app.openapi_url}", f"{root}/static/docs"


@router.get("/docs", name="swagger_ui", include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    openapi, assets = _docs_urls(request)
    return get_swagger_ui_html(
        openapi_url=openapi, title=f"{request.app.title} - Swagger UI", oauth2_redirect_url=None,
        swagger_js_url=f"{assets}/swagger-ui-bundle.js", swagger_css_url=f"{assets}/swagger-ui.css",
        swagger_favicon_url=f"{assets}/favicon.png",
        # validatorUrl None: no badge image from the online validator
        swagger_ui_parameters={**(request.app.swagger_ui_parameters or {}), "validatorUrl": None},
    )


@router.get("/redoc", name="redoc", include_in_schema=False)
async def redoc(request: Request) -> HTMLResponse:
    openapi, assets = _docs_urls(request)
    return get_redoc_html(openapi_url=openapi, title=f"{request.app.title} - ReDoc",
                          redoc_js_url=f"{assets}/redoc.standalone.js", redoc_favicon_url=f"{assets}/favicon.png",
                          with_google_fonts=False)


@router.get("/static/docs/{name}", name="docs_assets", include_in_schema=False)
async def docs_assets(name: str) -> FileResponse:
    """Swagger UI's and ReDoc's files (swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png)."""
    return _files(name, DOCS_ASSETS_DIR)
