"""A real ``specserve serve`` on a loopback port and headless Chromium (Debian's
``chromium`` and ``chromium-driver``, driven by selenium) on its playground page.

``python -m tests.gateway.browser OUT.png`` (``make screenshot``) serves the default
model, asks the playground the same question with speculation on and off side by
side, and saves a screenshot.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import KEPT_VARIABLES, free_port, http_status, stop_process

REPO = Path(__file__).resolve().parents[2]
ANSWER_SECONDS = 180  # a streamed answer of the default model on a small CPU
SCREENSHOT_PROMPT = ("Here is a shopping list: eggs, flour, milk, butter, sugar, lemons. "
                     "Write the list again as a numbered list, then suggest one cake to bake.")


def _read(log: IO[str]) -> str:
    log.seek(0)
    return log.read()


@contextmanager
def serve(args: Sequence[str], timeout: float = 900) -> Iterator[str]:
    """``specserve serve ARGS`` on a free loopback port until ``/ready``; yields its URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPECSERVE_", "OTEL_")) or k in KEPT_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryFile(mode="w+") as log:  # a file, not a pipe: never blocks
        process = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port), "--metrics-port", str(free_port()), *args],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while http_status(f"{url}/ready") != 200:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"specserve serve did not get ready:\n{_read(log)}")
                time.sleep(0.2)
            yield url
        finally:
            stop_process(process, 30)


def chromium(width: int = 1280, height: int = 900) -> WebDriver:
    """Headless Chromium from the system packages (no driver download)."""
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def enter_key(driver: WebDriver, key: str) -> None:
    """Type ``key`` into the page's API-key box (shown when the server wants one)."""
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "key-box").is_displayed())
    box = driver.find_element(By.ID, "api-key")
    box.clear()
    box.send_keys(key)
    driver.find_element(By.ID, "key-save").click()


def wait_until_loaded(driver: WebDriver) -> None:
    """Until the page knows the model (the send button is enabled then)."""
    WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "send").is_enabled())


def ask(driver: WebDriver, prompt: str, answers: int = 1) -> list[WebElement]:
    """Send ``prompt``; wait for the newest ``answers`` answers to finish streaming."""
    before = len(driver.find_elements(By.CSS_SELECTOR, ".answer"))
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()

    def finished(d: WebDriver) -> list[WebElement] | bool:
        found = d.find_elements(By.CSS_SELECTOR, ".answer")[before:]
        done = [a for a in found if a.get_attribute("data-done") == "true"]
        return done if len(done) == answers else False

    result: list[WebElement] = WebDriverWait(driver, ANSWER_SECONDS).until(finished)
    return result


def screenshot(out: Path) -> None:
    with serve(["--draft", "auto", "--max-tokens", "160"]) as url:
        driver = chromium(1280, 820)
        try:
            driver.get(url + "/")
            wait_until_loaded(driver)
            driver.find_element(By.ID, "compare").click()
            max_tokens = driver.find_element(By.ID, "max-tokens")
            max_tokens.clear()
            max_tokens.send_keys("96")
            ask(driver, SCREENSHOT_PROMPT, answers=2)
            out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
    print(out)


if __name__ == "__main__":
    screenshot(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/playground.png"))
