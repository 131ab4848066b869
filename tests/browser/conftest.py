"""One ``make lab`` server and one headless Chromium for every browser test of the session (the chapters run in
one lab session, as a learner's would)."""
import pytest

from tests.browser.lab_ui import IDLE_S, SETTINGS, chromium_path
from tests.lab_server import make_lab


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    with make_lab(tmp_path_factory.mktemp("lab"), SETTINGS, env={"COURSE_POOL_IDLE_S": str(IDLE_S)}) as server:
        yield server


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=chromium_path(),
                                      args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield chromium
        chromium.close()
