"""A headless system Chromium driven by Selenium through the system chromedriver: nothing is
downloaded at test time (the driver's path is given, so Selenium Manager never runs)."""

from __future__ import annotations

import os
import shutil

import pytest

BROWSER_NAMES = ("chromium", "chromium-browser")
DRIVER_NAME = "chromedriver"
# Headless as root (no sandbox), with /tmp for shared memory (a container's /dev/shm is small),
# and none of the browser's own traffic (updates, sync, field trials) leaving the machine.
_ARGUMENTS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1200,900",
)


def system_browser() -> tuple[str, str]:
    """The paths of the system's Chromium and chromedriver. Without one, the calling test skips
    naming it; in CI (CI=true) it fails instead, since CI must run the browser tests."""
    browser = next((path for name in BROWSER_NAMES if (path := shutil.which(name))), None)
    driver = shutil.which(DRIVER_NAME)
    found = {" or ".join(BROWSER_NAMES): browser, DRIVER_NAME: driver}
    missing = [name for name, path in found.items() if not path]
    if missing:
        reason = f"no {' and no '.join(missing)} on PATH (Debian: apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return browser, driver


def start_chromium():
    """A headless Chromium whose console messages, errors included, can be read with
    `driver.get_log("browser")`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = system_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in _ARGUMENTS:
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)
