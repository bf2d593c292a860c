"""The playground in headless Chromium against a real ``specserve serve`` on the
default model (n-gram lookup, continuation drafts and the shipped draft model), with
an API key: the page asks for the key, streams coloured answers whose text is the
API's greedy answer, and shows model output as text, never as HTML."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import require_program
from tests.gateway.browser import ask, chromium, enter_key, serve, wait_until_loaded

pytestmark = pytest.mark.real_model

KEY = "playground-key"
MAX_TOKENS = 40
ACCEPTED = {"lookup", "cache", "model"}
COPY = "Repeat this sentence twice: The quick brown fox jumps over the lazy dog."
SCRIPT = "Repeat exactly, nothing else: <script>window.pwned=1</script>"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    require_program("chromium", "chromium")
    require_program("chromedriver", "chromium-driver")
    with serve(["--draft", "auto", "--api-key", KEY, "--threads", "2"]) as url:
        yield url


@pytest.fixture()
def page(server: str) -> Iterator[WebDriver]:
    """The playground, loaded and given the key."""
    driver = chromium()
    try:
        driver.get(server + "/")
        enter_key(driver, KEY)
        wait_until_loaded(driver)
        tokens = driver.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys(str(MAX_TOKENS))
        yield driver
        problems = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"
                    and "401 (Unauthorized)" not in e["message"]]  # the page's first try
        assert not problems, problems  # no CSP violation, no script error, no failed load
    finally:
        driver.quit()


def api_answer(url: str, prompt: str, **extra: Any) -> str:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def spans(answer: WebElement) -> list[tuple[str, str]]:
    return [(s.get_attribute("data-origin") or "", s.get_attribute("textContent") or "")
            for s in answer.find_elements(By.CSS_SELECTOR, "span.tok")]


def figure(pane: WebElement, name: str) -> str:
    return pane.find_element(By.CSS_SELECTOR, f'.figure[data-name="{name}"] b').text


def test_the_page_asks_for_the_key(server: str) -> None:
    driver = chromium()
    try:
        driver.get(server + "/playground")
        enter_key(driver, "wrong")
        WebDriverWait(driver, 30).until(
            lambda d: d.find_element(By.ID, "key-error").text == "That key was refused.")
        assert not driver.find_element(By.ID, "send").is_enabled()
        enter_key(driver, KEY)
        wait_until_loaded(driver)
        assert not driver.find_element(By.ID, "key-box").is_displayed()
        names = [o.text for o in driver.find_elements(By.CSS_SELECTOR, "#drafter option")]
        assert "ngram+cache+default-draft" in names and "default-draft" in names
    finally:
        driver.quit()


def test_a_streamed_answer_is_coloured_and_equals_the_api(server: str, page: WebDriver) -> None:
    (answer,) = ask(page, COPY)
    pieces = spans(answer)
    assert pieces and {origin for origin, _ in pieces} <= ACCEPTED | {"target"}
    assert any(origin in ACCEPTED for origin, _ in pieces), "accepted drafts are coloured"
    assert any(origin == "target" for origin, _ in pieces)
    text = answer.get_attribute("textContent")
    assert text == "".join(piece for _, piece in pieces)
    assert text == api_answer(server, COPY, speculation={"enabled": False})
    pane = page.find_element(By.CSS_SELECTOR, ".pane")
    assert int(figure(pane, "accepted")) > 0 and int(figure(pane, "tokens")) > 0
    assert figure(pane, "TTFT").endswith(" ms") and float(figure(pane, "tok/s")) > 0
    rows = pane.find_elements(By.CSS_SELECTOR, "details tr")
    assert len(rows) - 1 == int(figure(pane, "rounds"))  # one row per round, plus the header


def test_a_prediction_s_tokens_have_their_own_colour(server: str, page: WebDriver) -> None:
    """The answer itself as the predicted output: the text is the API's greedy answer,
    drafts from the prediction are coloured as such, and the figures count its tokens
    found in the answer."""
    expected = api_answer(server, COPY, speculation={"enabled": False})
    page.find_element(By.CSS_SELECTOR, "#prediction-box summary").click()
    page.find_element(By.ID, "prediction").send_keys(expected)
    (answer,) = ask(page, COPY)
    pieces = spans(answer)
    assert answer.get_attribute("textContent") == expected
    assert any(origin == "prediction" for origin, _ in pieces), pieces
    pane = page.find_element(By.CSS_SELECTOR, ".pane")
    assert int(figure(pane, "prediction tokens in the answer")) > 0


def test_model_output_is_text_never_html(server: str, page: WebDriver) -> None:
    (answer,) = ask(page, SCRIPT)
    expected = api_answer(server, SCRIPT)
    assert "<script>" in expected  # the model repeats the markup
    assert answer.get_attribute("textContent") == expected
    assert answer.find_elements(By.CSS_SELECTOR, "script, img, iframe") == []
    assert page.execute_script("return typeof window.pwned") == "undefined"


def test_the_same_prompt_both_ways_side_by_side(server: str, page: WebDriver) -> None:
    page.find_element(By.ID, "compare").click()
    on, off = ask(page, COPY, answers=2)
    assert on.get_attribute("textContent") == off.get_attribute("textContent")
    assert {origin for origin, _ in spans(off)} == {"target"}
    panes = page.find_elements(By.CSS_SELECTOR, ".pane")
    assert [p.get_attribute("data-speculation") for p in panes] == ["on", "off"]
    assert int(figure(panes[0], "drafted")) > 0 and int(figure(panes[1], "drafted")) == 0
