"""Screenshots of the chat page for the README, taken by the system's headless Chromium from a real
server: `python scripts/page_screenshots.py [--model default] [--out docs]`.

Starts the server in this process (the model as `specdec serve` loads it, with `--drafter`), asks
one question through the page with a side-by-side plain run, and writes `NAME-desktop.png` and
`NAME-phone.png` (`--name`, default `page`). The Qwen pair's picture:
`--model qwen2.5-coder-1.5b-instruct --drafter auto --prompt "Write a Python function ..." --max-tokens 160 --name page-qwen --desktop-only`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from specdec import Engine
from specdec.builder import pair_draft_vocab, resolve_drafter
from specdec.server.app import ServerSettings, create_app

CODE_PROMPT = ('def area_of_square(side):\n    """The area of a square."""\n    return side * side\n\n\n'
               'def area_of_rectangle(width, height):\n')
PORT = 8731


def start_server(model: str, drafter: str) -> str:
    engine = Engine.load(model, drafter="none")
    drafter, p_min = resolve_drafter(drafter, model)  # "auto": as `specdec serve` resolves it
    settings = ServerSettings(model=model, served_model_name=model, drafter=drafter, draft_p_min=p_min,
                              draft_vocab=pair_draft_vocab(model), max_model_len=1024)
    server = uvicorn.Server(uvicorn.Config(create_app(settings, load=lambda s: (engine.model, engine.tokenizer)),
                                           host="127.0.0.1", port=PORT, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{PORT}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return url
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            sys.exit("the server did not start")
        time.sleep(0.2)


def browser() -> webdriver.Chrome:
    options = Options()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def ask(driver, url: str, prompt: str, max_tokens: int) -> None:
    driver.get(url + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url + "/")
    wait = WebDriverWait(driver, 300, poll_frequency=0.1)
    wait.until(lambda d: "Model" in d.find_element(By.ID, "model-line").text)
    driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    field = driver.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    driver.find_element(By.ID, "compare").click()
    driver.find_element(By.CSS_SELECTOR, "#settings summary").click()  # closed again for the picture
    box = driver.find_element(By.ID, "message")
    for i, line in enumerate(prompt.split("\n")):
        if i:
            box.send_keys(Keys.SHIFT, Keys.ENTER)
        box.send_keys(line)
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#log .plain-line"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", default="docs")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--prompt", default=CODE_PROMPT)
    parser.add_argument("--name", default="page")
    parser.add_argument("--desktop-only", action="store_true")
    args = parser.parse_args()
    url = start_server(args.model, args.drafter)
    driver = browser()
    try:
        driver.set_window_size(1100, 1250)
        ask(driver, url, args.prompt, args.max_tokens)
        driver.save_screenshot(str(Path(args.out) / f"{args.name}-desktop.png"))
        if args.desktop_only:
            return
        driver.set_window_size(390, 1100)
        driver.refresh()
        WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#log .stats dl"))
        driver.save_screenshot(str(Path(args.out) / f"{args.name}-phone.png"))
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
