"""Headless Chromium driven by selenium, for the tests of the pages (the playground, the API docs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # a dev dependency: chromium_driver fails loudly rather than skip
    webdriver = By = Select = None

__all__ = ["OFFLINE_FLAGS", "By", "Select", "chromium_driver", "severe_console_errors", "wait"]

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1500,1100")
# An air-gapped network as the page sees it: every host name but the test server's fails to resolve, and what
# goes by IP address meets a proxy that refuses (Chromium never proxies loopback, so 127.0.0.1 still answers).
OFFLINE_FLAGS = ("--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "--proxy-server=127.0.0.1:9")


@contextmanager
def chromium_driver(chromium: tuple[str, str], profile: Path, extra_flags: tuple[str, ...] = ()) -> Iterator:
    """A WebDriver on the (binary, chromedriver) pair of the ``chromium`` fixture, with a fresh profile."""
    if webdriver is None:
        pytest.fail("selenium is not installed: it is a dev dependency (pip install -r requirements-dev.txt)")
    binary, driver_path = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*CHROMIUM_FLAGS, *extra_flags):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, condition, timeout_s: float = 30.0, message: str = ""):
    """The first truthy value of ``condition(driver)``, polled as the page changes (a bound on a hang, not a pace)."""
    return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda d: condition(d), message)


def severe_console_errors(driver) -> list[str]:
    """The console's errors since the last call (a resource that failed to load is one)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
