"""/docs (Swagger UI) and /redoc render in the real browser with no network but the server's: the clusters this
runs in are often air-gapped, and FastAPI's own pages load their scripts from a CDN (a blank page there)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.browser import OFFLINE_FLAGS, By, chromium_driver, severe_console_errors, wait
from tests.service.server import Server, running_server

CDN_FILE = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"  # what FastAPI's /docs loads

# fetch() from the page: "ok" when it got an answer, else the error (the callback is selenium's last argument).
FETCH = """const done = arguments[arguments.length - 1];
fetch(arguments[0], {mode: "no-cors"}).then(() => done("ok"), (err) => done(String(err)));"""
# ReDoc's "API docs by Redocly" link shows this image, and hides it when it cannot load (ReDoc has no option
# to leave it out): the one file of the pages that is not the server's.
REDOCLY_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
PAGE_TEXT = "return document.body.textContent;"  # textContent: the text as written, whatever CSS transforms
RESOURCES = "return performance.getEntriesByType('resource').map((e) => e.name);"


@pytest.fixture(scope="module")
def server(models_dir: Path, adapters_dir: Path) -> Iterator[Server]:
    with running_server(models_dir, adapters_dir) as s:
        yield s


@pytest.fixture
def offline_browser(chromium: tuple[str, str], tmp_path: Path) -> Iterator:
    with chromium_driver(chromium, tmp_path / "chromium-profile", OFFLINE_FLAGS) as driver:
        yield driver


def summaries(server: Server) -> list[str]:
    """The summary of every operation the OpenAPI document lists."""
    spec = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    return [op["summary"] for ops in spec["paths"].values() for op in ops.values() if "summary" in op]


def assert_loaded_only_the_servers_files(driver, server: Server) -> None:
    """Every file the page asked for came from the server (but the logo below), the favicon too."""
    outside = [url for url in driver.execute_script(RESOURCES) if not url.startswith(server.url)]
    assert set(outside) <= {REDOCLY_LOGO}, outside
    favicon = driver.execute_script("return document.querySelector('link[rel~=icon]').href;")
    assert favicon.startswith(server.url) and httpx.get(favicon, timeout=10).status_code == 200
    errors = [e for e in severe_console_errors(driver) if REDOCLY_LOGO not in e]  # a file that failed to load is one
    assert not errors, errors


def assert_out_of_reach(driver, server: Server) -> None:
    """The control: from this page the server answers and a CDN does not."""
    driver.set_script_timeout(30)
    assert driver.execute_async_script(FETCH, f"{server.url}/openapi.json") == "ok"
    assert driver.execute_async_script(FETCH, CDN_FILE) != "ok", "the browser reached a CDN: the test proves nothing"


# The page, and what marks an operation drawn on it.
PAGES = [("/docs", ".opblock-summary"), ("/redoc", "[data-section-id^='operation/']")]


@pytest.mark.parametrize(("path", "operation"), PAGES)
def test_the_api_docs_render_with_no_network(offline_browser, server: Server, path: str, operation: str):
    wanted = summaries(server)
    assert len(wanted) > 10 and "List Models" in wanted
    offline_browser.get(f"{server.url}{path}")
    wait(offline_browser, lambda d: d.find_elements(By.CSS_SELECTOR, operation),
         message=f"{path} drew no operation: a blank page (did it load its scripts from a CDN?)")
    wait(offline_browser, lambda d: all(s in d.execute_script(PAGE_TEXT) for s in wanted))
    assert_loaded_only_the_servers_files(offline_browser, server)
    assert_out_of_reach(offline_browser, server)
