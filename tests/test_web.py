"""The chat page at / in a real headless Chromium (the system's package, driven by Selenium),
against a real server on the default model: a streamed answer whose coloured tokens are the API's
answer, stop freeing the row, model output and imported conversations shown as text, the API key
flow, axe-core's report and the page's size. `make install` installs Chromium when it is missing.
"""

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from selenium import webdriver  # the `test` extra: these tests run, never skip
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from specdec.server.app import ServerSettings, create_app
from specdec.server.web import PAGE_FILES
from test_server import ThreadServer, metric

AXE = Path(__file__).parent / "web" / "axe.min.js"
PAGE_BUDGET = 150 * 1024  # bytes, uncompressed: everything / loads
# Repeats itself, so prompt lookup drafts and the model accepts some of it.
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
HOSTILE = ["<script>window.pwned=1</script>", "<img src=x onerror=window.pwned=1>"]
KEY = "sk-web-test"


def chromium() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        pytest.fail("the browser tests need the system's chromium and chromedriver: `make install` installs them "
                    "(apt-get install chromium chromium-driver)")
    return browser, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary, driver_path = chromium()
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    downloads = tmp_path_factory.mktemp("downloads")
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    yield driver
    driver.quit()


def serve(engine, **extra) -> ThreadServer:
    settings = ServerSettings(served_model_name="gemma", drafter="ngram", max_batch=4, max_model_len=1024,
                              dtype="float32", **extra)
    return ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()


@pytest.fixture(scope="module")
def server(default_engine_fp32):
    srv = serve(default_engine_fp32)
    yield srv.url
    srv.stop()


def wait(driver, condition, timeout=60, what="the page"):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"timed out waiting for {what}; page errors: {page_error(driver)!r}") from None


def page_error(driver) -> str:
    return driver.execute_script("return document.getElementById('error').textContent")


def open_page(driver, url):
    """A fresh page with nothing stored, once it knows the model."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url + "/")
    wait(driver, lambda d: "Model gemma" in d.find_element(By.ID, "model-line").text, what="the model line")


def settings(driver, **values):
    """Open Settings and set fields by element id (text fields and checkboxes)."""
    details = driver.find_element(By.ID, "settings")
    if not details.get_attribute("open"):
        details.find_element(By.TAG_NAME, "summary").click()
    for key, value in values.items():
        field = driver.find_element(By.ID, key.replace("_", "-"))
        if isinstance(value, bool):
            if field.is_selected() != value:
                field.click()
        else:
            field.clear()
            field.send_keys(str(value))
            driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def send(driver, text):
    box = driver.find_element(By.ID, "message")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)  # the keyboard path: Enter sends


def wait_idle(driver, timeout=120):
    def idle(d):
        return d.find_element(By.ID, "send").is_enabled() and not d.find_element(By.ID, "stop").is_enabled()

    wait(driver, idle, timeout, "the answer to finish")


def last_answer_tokens(driver) -> list[tuple[str, str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#log article.assistant:last-of-type .tokens .tok')]"
        ".map(s => [s.textContent, s.className])")


def api_text(url, prompt, max_tokens, key=None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    res = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                     headers=headers, timeout=120)
    assert res.status_code == 200, res.text
    return res.json()["choices"][0]["text"]


def test_page_loads_everything_from_itself_within_the_budget(browser, server):
    open_page(browser, server)
    loaded = browser.execute_script(
        "return performance.getEntriesByType('navigation').concat(performance.getEntriesByType('resource'))"
        ".map(e => [new URL(e.name).origin, new URL(e.name).pathname, e.decodedBodySize])")
    origins = {origin for origin, _, _ in loaded}
    assert origins == {server}, origins  # nothing fetched from elsewhere
    page = [(path, size) for _, path, size in loaded if path in PAGE_FILES]
    # Every file it loaded is one of the page's (a headless browser may skip the icon).
    assert {path for path, _ in page} >= set(PAGE_FILES) - {"/static/icon.svg"}
    assert {path for _, path, _ in loaded} <= set(PAGE_FILES) | {"/v1/models"}
    assert sum(size for _, size in page) <= PAGE_BUDGET
    # The same from the server's side, byte for byte uncompressed.
    assert sum(len(httpx.get(server + path).content) for path in PAGE_FILES) <= PAGE_BUDGET
    assert browser.execute_script("return typeof window.SpecdecMarkdown.render") == "function"
    # The CSP is in force: a script put on the page inline does not run.
    browser.execute_script("const s = document.createElement('script'); s.textContent = 'window.inline = 1';"
                           "document.body.appendChild(s);")
    assert browser.execute_script("return typeof window.inline") == "undefined"


def test_a_message_streams_and_its_coloured_tokens_are_the_api_answer(browser, server):
    open_page(browser, server)
    settings(browser, max_tokens=24, temperature=0)
    # Record the answer's text lengths as it grows: a streamed answer shows several.
    browser.execute_script("""
        window.seen = new Set();
        new MutationObserver(() => {
          const t = document.querySelector('#log article.assistant:last-of-type .tokens');
          const busy = document.getElementById('log').getAttribute('aria-busy') === 'true';
          if (t && busy) window.seen.add(t.textContent.length);
        }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});""")
    send(browser, PROMPT)
    wait_idle(browser)
    tokens = last_answer_tokens(browser)
    answer = "".join(text for text, _ in tokens)
    assert answer == api_text(server, PROMPT, 24)  # the same greedy request through the API
    kinds = {cls.split()[1] for _, cls in tokens}
    assert kinds <= {"draft", "target", "bonus"} and "draft" in kinds  # prompt lookup's accepted drafts
    assert len([n for n in browser.execute_script("return [...window.seen]") if 0 < n < len(answer)]) >= 1
    stats = browser.find_element(By.CSS_SELECTOR, "#log article.assistant .stats").text
    assert "tokens/s" in stats and "tokens per target pass" in stats
    chart = browser.find_element(By.CSS_SELECTOR, "#log article.assistant svg.chart")
    assert "position 1:" in chart.get_attribute("aria-label")
    # The conversation is kept: a reload shows it again.
    browser.refresh()
    wait(browser, lambda d: "".join(t for t, _ in last_answer_tokens(d)) == answer, what="the stored answer")


def test_side_by_side_plain_run(browser, server):
    open_page(browser, server)
    settings(browser, max_tokens=12, temperature=0, compare=True)
    send(browser, PROMPT)
    wait_idle(browser)
    line = browser.find_element(By.CSS_SELECTOR, "#log article.assistant .plain-line").text
    assert "Plain decoding:" in line and "same text: yes" in line  # greedy: speculation changes nothing


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_frees_the_row(browser, server, how):
    open_page(browser, server)
    settings(browser, max_tokens=900)
    cancelled = metric(server, "request_success_total", ',finished_reason="cancelled"')
    send(browser, "Once upon a time")
    wait(browser, lambda d: len("".join(t for t, _ in last_answer_tokens(d))) > 0, what="the first tokens")
    assert metric(server, "num_requests_running") == 1
    if how == "button":
        browser.find_element(By.ID, "stop").click()
    else:
        browser.find_element(By.ID, "message").send_keys(Keys.ESCAPE)
    wait_idle(browser)
    deadline = time.time() + 30
    while metric(server, "num_requests_running") != 0:
        assert time.time() < deadline, "the stopped request still holds its row"
        time.sleep(0.05)
    assert metric(server, "request_success_total", ',finished_reason="cancelled"') == cancelled + 1
    assert "Stopped." in browser.find_element(By.CSS_SELECTOR, "#log article.assistant").text


def assert_shown_as_text(driver, needles):
    time.sleep(0.3)  # an injected <img src=x> would have fired its onerror by now
    assert driver.execute_script("return typeof window.pwned") == "undefined"
    assert driver.execute_script("return document.querySelectorAll('#log img, #log script, nav img').length") == 0
    shown = driver.execute_script("return document.body.textContent")
    for needle in needles:
        assert needle in shown


def toggle_views(driver):
    for button in driver.find_elements(By.CSS_SELECTOR, "#log .view-toggle"):
        button.click()


def test_a_forced_html_answer_is_shown_as_text(browser, server):
    open_page(browser, server)
    settings(browser, max_tokens=40, extra=json.dumps({"structured_outputs": {"choice": HOSTILE}}))
    send(browser, "Pick one:")
    wait_idle(browser)
    answer = "".join(t for t, _ in last_answer_tokens(browser))
    assert answer in HOSTILE
    assert_shown_as_text(browser, [answer])
    toggle_views(browser)  # the formatted (Markdown) view too
    assert answer in browser.find_element(By.CSS_SELECTOR, "#log article.assistant .markdown").text
    assert_shown_as_text(browser, [answer])


def test_an_imported_conversation_is_shown_as_text_and_exports_back(browser, server, tmp_path):
    conversation = {"title": HOSTILE[1], "system": HOSTILE[0], "messages": [
        {"role": "user", "content": HOSTILE[0]},
        {"role": "assistant",
         "content": HOSTILE[1] + "\n\n```html\n" + HOSTILE[0] + "\n```\n[link](javascript:window.pwned=1)",
         "tokens": [{"text": HOSTILE[0], "source": "draft\" onmouseover=\"window.pwned=1"},
                    {"text": HOSTILE[1], "source": "bonus"}],
         "stats": {"tokens_per_s": 12.5, "tokens_per_pass": 1.5, "draft_tokens": 4, "accepted_tokens": 2,
                   "acceptance_rate": 0.5, "drafted_per_position": [2, 2], "accepted_per_position": [2, 0]}}]}
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"conversations": [conversation]}))
    open_page(browser, server)
    browser.find_element(By.ID, "import").send_keys(str(path))
    wait(browser, lambda d: "Imported 1 conversation" in d.find_element(By.ID, "import-status").text, what="the import")
    assert_shown_as_text(browser, HOSTILE)
    toggle_views(browser)
    assert_shown_as_text(browser, HOSTILE)
    assert browser.execute_script("return document.querySelectorAll('#log a').length") == 0  # javascript: is no link
    assert browser.find_element(By.CSS_SELECTOR, "#log .markdown pre code").text == HOSTILE[0]  # a code block
    assert browser.find_element(By.CSS_SELECTOR, "#conversations .conv").text == HOSTILE[1]
    # Export writes the conversations back as JSON.
    browser.find_element(By.ID, "export").click()
    exported = browser.downloads / "specdec-conversations.json"
    deadline = time.time() + 10
    while not exported.exists():
        assert time.time() < deadline, "nothing was downloaded"
        time.sleep(0.05)
    saved = json.loads(exported.read_text())["conversations"][0]
    assert saved["title"] == HOSTILE[1] and saved["messages"][1]["tokens"][0]["text"] == HOSTILE[0]
    assert saved["messages"][1]["tokens"][0]["source"] == "none"  # an unknown source is not kept


def test_api_key_flow(browser, default_engine_fp32):
    srv = serve(default_engine_fp32, api_key=KEY)
    try:
        assert httpx.get(srv.url + "/").status_code == 200  # the page itself needs no key
        assert httpx.get(srv.url + "/v1/models").status_code == 401  # the API still does
        browser.get(srv.url + "/")
        browser.execute_script("localStorage.clear(); sessionStorage.clear();")
        browser.get(srv.url + "/")
        dialog = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#key-dialog[open]"), what="the key dialog")
        field = browser.find_element(By.ID, "key-input")
        field.send_keys("sk-wrong" + Keys.ENTER)
        wait(browser, lambda d: "refused" in d.find_element(By.ID, "key-why").text, what="the refusal")
        field.clear()
        field.send_keys(KEY + Keys.ENTER)
        wait(browser, lambda d: "Model gemma" in d.find_element(By.ID, "model-line").text, what="the model line")
        assert not dialog.get_attribute("open")
        assert browser.execute_script("return sessionStorage.getItem('specdec.apiKey')") == KEY
        assert browser.execute_script("return localStorage.getItem('specdec.apiKey')") is None
        settings(browser, max_tokens=4)
        send(browser, PROMPT)
        wait_idle(browser)
        assert "".join(t for t, _ in last_answer_tokens(browser)) == api_text(srv.url, PROMPT, 4, key=KEY)
        # Kept for the tab: a reload asks nothing.
        browser.refresh()
        wait(browser, lambda d: "Model gemma" in d.find_element(By.ID, "model-line").text, what="the model line")
        assert not browser.find_element(By.ID, "key-dialog").get_attribute("open")
    finally:
        srv.stop()


def axe_violations(driver) -> list[dict]:
    driver.execute_script(AXE.read_text())
    driver.set_script_timeout(60)
    found = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document).then(r => done(r.violations), e => done([{id: String(e)}]));")
    return [{"id": v["id"], "impact": v.get("impact"), "nodes": [n["target"] for n in v.get("nodes", [])][:3]}
            for v in found if v.get("impact") in ("serious", "critical", None)]


@pytest.mark.parametrize("width,height", [(1200, 900), (390, 844)])
def test_axe_finds_no_serious_or_critical_violation(browser, server, tmp_path, width, height):
    conversation = {"title": "Axe", "messages": [
        {"role": "user", "content": "Write a loop"},
        {"role": "assistant",
         "content": "Here:\n\n```python\nfor i in range(3):\n    print(i)\n```\n- one **two** `three`",
         "tokens": [{"text": "Here:", "source": "target"}, {"text": " for", "source": "draft"},
                    {"text": " i", "source": "bonus"}],
         "stats": {"tokens_per_s": 10, "tokens_per_pass": 1.4, "draft_tokens": 6, "accepted_tokens": 3,
                   "acceptance_rate": 0.5, "drafted_per_position": [3, 2, 1], "accepted_per_position": [2, 1, 0]},
         "plain": {"text": "Here:", "stats": {"tokens_per_s": 7}}}]}
    path = tmp_path / "axe.json"
    path.write_text(json.dumps(conversation))
    browser.set_window_size(width, height)
    try:
        open_page(browser, server)
        browser.find_element(By.ID, "import").send_keys(str(path))
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#log svg.chart"), what="the imported chart")
        settings(browser)  # open too, so its fields are checked
        assert axe_violations(browser) == []
        # Phone width: nothing wider than the screen.
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    finally:
        browser.set_window_size(1200, 900)


def test_a_prediction_is_drafted_from(browser, server):
    expected = api_text(server, PROMPT, 24)
    open_page(browser, server)
    settings(browser, max_tokens=24, temperature=0, speculate=True, prediction=expected)
    send(browser, PROMPT)
    wait_idle(browser)
    tokens = last_answer_tokens(browser)
    assert "".join(t for t, _ in tokens) == expected  # the output is unchanged by a prediction
    drafted = sum(len(t) for t, cls in tokens if cls.endswith("draft"))
    assert drafted > len(expected) / 2  # most of it came from the pasted prediction


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    pytest.importorskip("llguidance")
    from specdec import Engine
    from tool_models import make_tool_model

    folder, _ = make_tool_model(tmp_path_factory.mktemp("web-tools"), "qwen")
    engine = Engine.load(str(folder), dtype="float32")
    settings = ServerSettings(model=str(folder), served_model_name="gemma", drafter="ngram", max_model_len=2048,
                              dtype="float32", speculation_control="budget")
    srv = ThreadServer(create_app(settings, load=lambda s: (engine.model, engine.tokenizer))).start()
    yield srv.url
    srv.stop()


def test_a_chat_model_streams_through_chat_completions_and_shows_a_tool_call(browser, chat_server):
    from test_tools import TOOLS

    ask = "What is the weather in Paris?"
    res = httpx.post(chat_server + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": ask}], "max_tokens": 12, "temperature": 0})
    open_page(browser, chat_server)
    assert "(chat)" in browser.find_element(By.ID, "model-line").text
    settings(browser, max_tokens=12, temperature=0)
    send(browser, ask)
    wait_idle(browser)
    assert "".join(t for t, _ in last_answer_tokens(browser)) == res.json()["choices"][0]["message"]["content"]
    # With tools and tool_choice "required" the answer is a call, shown as one.
    body = {"messages": [{"role": "user", "content": ask}], "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    call = httpx.post(chat_server + "/v1/chat/completions", json=body, timeout=120).json()[
        "choices"][0]["message"]["tool_calls"][0]["function"]
    settings(browser, max_tokens=200, tools=json.dumps(TOOLS),
             extra=json.dumps({"tool_choice": "required", "parallel_tool_calls": False}))
    browser.find_element(By.ID, "new-chat").click()
    send(browser, ask)
    wait_idle(browser)
    shown = browser.find_element(By.CSS_SELECTOR, "#log article.assistant .tool-call").text
    assert f"Tool call: {call['name']}" in shown
    assert json.loads(shown.split("\n", 1)[1]) == json.loads(call["arguments"])
