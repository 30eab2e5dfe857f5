"""The chat page in a real headless Chromium against a real server started with an API key:
it loads clean, streams, shows each reply's TTFT and its stages, stops, pins, clears, keeps
markup inert and fits a phone's screen."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from firsttoken.server.server_config import ServerConfig
from tests.http_client import HTTP
from tests.server.browser import start_chromium, system_browser
from tests.server.conftest import MODEL_NAME, running_server

API_KEY = "browser-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCREENSHOT = pathlib.Path(__file__).resolve().parents[2] / "bench_results" / "chat_page.png"
WAIT_S = 60
SHORT_REPLY_TOKENS = 12
# At temperature 0 the test model tells this story well past a thousand tokens.
ENDLESS_PROMPT = "Tell me a very long story about a dragon."
SYSTEM_PROMPT = "You are a patient tutor who explains each step of a calculation and checks the result twice."
# Renders as DOM the way a model reply does; any of it that ran would set window.__ran.
HOSTILE_TEXT = (
    '<script>window.__ran = 1</script> <img src=x onerror="window.__ran = 2">'
    " and `<b>inline</b>`, ``a ` <i>b</i>``\n"
    "```html\n<script>window.__ran = 3</script>\n```\n"
)
RENDERED_TAGS = {"p", "code", "figure", "figcaption", "pre"}


@pytest.fixture(scope="module")
def server(model_path):
    system_browser()  # skip (or fail in CI) before loading a model for nothing
    config = ServerConfig(port=0, served_model_names=(MODEL_NAME,), api_key=API_KEY)
    with running_server(model_path, config) as running:
        yield running


@pytest.fixture(scope="module")
def chromium(server):
    browser = start_chromium()
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture
def page(chromium, server):
    """The page freshly loaded with the API key in its localStorage, greedy short replies set,
    and the browser's console log emptied of anything before this load."""
    driver = chromium
    driver.set_window_size(1200, 900)
    driver.get(server.base_url + "/")
    driver.execute_script("localStorage.setItem('firsttoken.apiKey', arguments[0])", API_KEY)
    driver.get_log("browser")
    driver.get(server.base_url + "/")
    _wait(driver, lambda d: _models(d) == [MODEL_NAME])
    _set_sampling(driver, temperature="0", max_tokens=SHORT_REPLY_TOKENS)
    return driver


# -- helpers --------------------------------------------------------------------------------------


def _wait(driver, condition, timeout_s: float = WAIT_S) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.02).until(condition)


def _by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def _models(driver) -> list[str]:
    return driver.execute_script("return [...document.getElementById('model').options].map(o => o.value)")


def _set_sampling(driver, temperature: str, max_tokens: int) -> None:
    for element_id, value in (("temperature", temperature), ("max-tokens", str(max_tokens))):
        field = _by_id(driver, element_id)
        field.clear()
        field.send_keys(value)


def _send(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    _by_id(driver, "prompt").send_keys(text, Keys.ENTER)


def _replies(driver) -> list[dict[str, Any]]:
    """Each assistant reply: its text, whether it is still streaming, and its data-* figures."""
    return driver.execute_script(
        """return [...document.querySelectorAll('#conversation li.assistant')].map(item => ({
            text: item.querySelector('.body').textContent,
            streaming: item.classList.contains('streaming'),
            data: {...item.dataset},
            stages: [...item.querySelectorAll('.stage')].map(s => [s.dataset.stage, Number(s.dataset.ms)]),
            note: item.querySelector('.note, .error')?.textContent ?? null,
        }))"""
    )


def _send_and_wait(driver, text: str) -> dict[str, Any]:
    before = len(_replies(driver))
    _send(driver, text)
    replies = _wait(driver, lambda d: (r := _replies(d)) and len(r) > before and not r[-1]["streaming"] and r)
    assert replies[-1]["note"] is None, replies[-1]["note"]
    return replies[-1]


def _console_errors(driver) -> list[dict[str, Any]]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


# -- tests ----------------------------------------------------------------------------------------


def test_the_page_asks_for_the_api_key_and_keeps_it(chromium, server):
    from selenium.webdriver.common.keys import Keys

    driver = chromium
    driver.get(server.base_url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(server.base_url + "/")
    _wait(driver, lambda d: "API key" in _by_id(d, "status").text)
    key_field = _by_id(driver, "api-key")
    assert driver.switch_to.active_element == key_field
    assert _models(driver) == []
    key_field.send_keys(API_KEY, Keys.ENTER)
    _wait(driver, lambda d: _models(d) == [MODEL_NAME])
    assert driver.execute_script("return localStorage.getItem('firsttoken.apiKey')") == API_KEY
    driver.get(server.base_url + "/")
    _wait(driver, lambda d: _models(d) == [MODEL_NAME])


def test_a_reply_streams_into_the_page_with_no_console_error(page):
    # Records the reply's length at every change of the conversation: streaming shows several.
    page.execute_script(
        """window.replyLengths = [];
        new MutationObserver(() => {
            const bodies = document.querySelectorAll('#conversation li.assistant .body');
            if (bodies.length) window.replyLengths.push(bodies[bodies.length - 1].textContent.length);
        }).observe(document.getElementById('conversation'), {childList: true, subtree: true});"""
    )
    _set_sampling(page, temperature="0", max_tokens=32)
    reply = _send_and_wait(page, "Write three sentences about the sea.")
    assert reply["text"].strip()
    lengths = [length for length in page.execute_script("return window.replyLengths") if length]
    assert len(set(lengths)) >= 2 and lengths == sorted(lengths), lengths
    assert _console_errors(page) == []
    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert page.save_screenshot(str(SCREENSHOT))


def test_each_reply_shows_its_ttft_stages_cached_tokens_and_speed(page):
    first = _send_and_wait(page, "Name a colour.")
    second = _send_and_wait(page, "Name another one.")
    for reply in (first, second):
        data = reply["data"]
        ttft_ms, total_ms, server_ttft_ms = (float(data[k]) for k in ("ttftMs", "totalMs", "serverTtftMs"))
        assert 0 < server_ttft_ms <= ttft_ms < total_ms
        stages = dict(reply["stages"])
        assert list(stages) == ["tokenize", "queue", "prefill", "handoff", "rest"]
        assert all(ms >= 0 for ms in stages.values()) and stages["prefill"] > 0
        # The server's stages sum to its TTFT; the rest is the network's and the page's.
        server_stages_ms = sum(ms for name, ms in stages.items() if name != "rest")
        assert server_stages_ms == pytest.approx(server_ttft_ms, abs=0.02)
        assert stages["rest"] == pytest.approx(ttft_ms - server_ttft_ms, abs=0.2)
        assert float(data["decodeTokensPerS"]) > 0
    # The second request repeats the first exchange: its prefix comes from the prompt cache.
    assert int(second["data"]["cachedTokens"]) >= 16
    assert "over the last 2 replies" in _by_id(page, "ttft-summary").text


def test_stop_aborts_the_stream_and_the_server_ends_the_request(page, server):
    start = server.engine.stats()
    aborted_before = server.metric("firsttoken:request_success_total", finished_reason="abort")
    _set_sampling(page, temperature="0", max_tokens=1500)
    _send(page, ENDLESS_PROMPT)
    _wait(page, lambda d: (r := _replies(d)) and r[-1]["text"].strip())
    assert server.metric("firsttoken:num_requests_running") == 1
    _by_id(page, "stop").click()
    reply = _wait(page, lambda d: (r := _replies(d)) and not r[-1]["streaming"] and r[-1])
    assert reply["note"] == "Stopped."
    assert _by_id(page, "stop").get_attribute("disabled") is not None
    assert _by_id(page, "send").get_attribute("disabled") is None
    server.wait_for_idle_kv(since=start)
    assert server.metric("firsttoken:num_requests_running") == 0
    assert server.metric("firsttoken:request_success_total", finished_reason="abort") == aborted_before + 1


def test_markup_in_a_reply_is_shown_as_text(page):
    rendered = page.execute_async_script(
        """const [text, done] = arguments;
        import('/web/markdown.js').then((markdown) => {
            const item = document.createElement('li');
            item.className = 'message assistant';
            const body = document.createElement('div');
            body.className = 'body';
            body.append(markdown.renderMarkdown(text));
            item.append(body);
            document.getElementById('conversation').append(item);
            setTimeout(() => done({
                text: body.textContent,
                tags: [...body.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),
                code: [...body.querySelectorAll('pre code, p code')].map(e => e.textContent),
                ran: window.__ran ?? null,
            }), 100);
        });""",
        HOSTILE_TEXT,
    )
    assert rendered["ran"] is None
    assert set(rendered["tags"]) <= RENDERED_TAGS
    assert '<script>window.__ran = 1</script> <img src=x onerror="window.__ran = 2">' in rendered["text"]
    assert rendered["code"] == ["<b>inline</b>", "a ` <i>b</i>", "<script>window.__ran = 3</script>"]


def test_markup_in_a_typed_message_is_shown_as_text(page):
    _send_and_wait(page, "<b>bold?</b> <script>window.__ran = 4</script>")
    user = page.execute_script(
        """const body = document.querySelector('#conversation li.user .body');
        const tags = [...body.querySelectorAll('*')].map(e => e.tagName.toLowerCase());
        return {text: body.textContent, tags, ran: window.__ran ?? null};"""
    )
    assert user == {"text": "<b>bold?</b> <script>window.__ran = 4</script>", "tags": ["p"], "ran": None}


def test_shift_enter_adds_a_line_and_enter_sends(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    prompt = _by_id(page, "prompt")
    prompt.send_keys("Say hi")
    ActionChains(page).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    prompt.send_keys("twice")
    assert prompt.get_attribute("value") == "Say hi\ntwice"
    assert _replies(page) == []
    prompt.send_keys(Keys.ENTER)
    _wait(page, lambda d: (r := _replies(d)) and not r[-1]["streaming"])
    assert prompt.get_attribute("value") == ""


def test_clear_starts_a_new_conversation(page):
    alone = _send_and_wait(page, "Hello")
    after_it = _send_and_wait(page, "Hello")
    assert int(after_it["data"]["promptTokens"]) > int(alone["data"]["promptTokens"])
    _by_id(page, "clear").click()
    assert _replies(page) == []
    again = _send_and_wait(page, "Hello")
    assert again["data"]["promptTokens"] == alone["data"]["promptTokens"]


def test_the_pin_toggle_pins_the_system_prompt_on_the_server(page, server):
    start = server.engine.stats()
    _by_id(page, "system-prompt").send_keys(SYSTEM_PROMPT)
    _by_id(page, "pin").click()
    _wait(page, lambda d: _by_id(d, "pin-status").text.startswith("Pinned:"))
    (pin,) = HTTP.get(server.base_url + "/v1/pins", headers=AUTH).json()["data"]
    assert f"{pin['num_tokens']} tokens" in _by_id(page, "pin-status").text
    assert _by_id(page, "system-prompt").get_attribute("readonly") is not None
    reply = _send_and_wait(page, "What is 2+2?")
    assert int(reply["data"]["cachedTokens"]) >= pin["num_tokens"]
    _by_id(page, "pin").click()
    _wait(page, lambda d: _by_id(d, "pin-status").text == "")
    assert HTTP.get(server.base_url + "/v1/pins", headers=AUTH).json()["data"] == []
    assert _by_id(page, "system-prompt").get_attribute("readonly") is None
    server.wait_for_idle_kv(since=start)


def test_the_page_fits_a_phone_screen(page):
    page.set_window_size(390, 844)
    overflow = "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
    assert page.execute_script(overflow) <= 0
    _send_and_wait(page, "Write one long sentence about mountains, rivers and the sea.")
    assert page.execute_script(overflow) <= 0
    assert _by_id(page, "send").is_displayed() and _by_id(page, "stop").is_displayed()
