"""Check the built documentation site in headless Chromium: `make docs-check`.

Serves the site on a free localhost port, opens the front page, a chapter with equations and a figure, an
API page and the experiment catalogue in Chromium (driven over the DevTools protocol), and fails if a page
logs a console error or an uncaught exception, a request fails, an image does not load, MathJax typesets nothing, or TeX delimiters
(`$`, `\\(`, `\\[`) are left in the text outside code. Saves a full-page PNG screenshot of each page.

    python docs/check_site.py _docs --shots _docs_shots [--chromium /usr/bin/chromium]

Needs Chromium (Debian: `apt-get install chromium`) and the `websocket-client` package.
"""
from __future__ import annotations

import argparse
import base64
import functools
import itertools
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import websocket

PAGES = [                      # (page, what it is, must it show equations, must it show a figure)
    ("index.html", "front page", True, False),
    ("noised.html", "chapter with equations and a figure", True, True),
    ("svm_kernels.html", "chapter with displays inside paragraphs", True, False),
    ("core.html", "chapter with equations in a table", True, False),
    ("reference/topk_nb.loss.svm.html", "API page", False, False),
    ("experiments/index.html", "experiment catalogue", False, False),
]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1280,1000"]
LEFT_OVER_TEX = ["$", "\\(", "\\)", "\\[", "\\]", "\\begin{"]   # "$": a dollar the parser did not take as math


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(folder: Path) -> tuple[ThreadingHTTPServer, int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


class Page:
    "One Chromium tab over the DevTools protocol: commands, and the events collected while waiting."

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: list[dict] = []

    def send(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e.get("method") == event for e in self.events):
                return
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            self.events.append(json.loads(self.ws.recv()))
        raise TimeoutError(f"no {event} within {timeout} s")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}...: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def errors(self) -> list[str]:
        "Console errors, uncaught exceptions, failed requests and error log entries seen so far."
        found = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                found.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
            elif method == "Runtime.exceptionThrown":
                details = p["exceptionDetails"]
                found.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                found.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}".strip())
            elif method == "Network.loadingFailed" and not p.get("canceled"):
                found.append(f"request failed: {p.get('errorText')} ({p.get('type')})")
        return found


PAGE_FACTS = """(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  await Promise.all([...document.images].map(img => img.complete ? null : new Promise(r => { img.onload = img.onerror = r; })));
  const main = document.querySelector('main') || document.body;
  const prose = main.cloneNode(true);          // the text outside code and typeset math, where TeX must not be left
  prose.querySelectorAll('pre, code, script, style, mjx-container').forEach(e => e.remove());
  return {
    title: document.title,
    text: prose.textContent,
    math_source: document.querySelectorAll('.math, span.math, div.math').length,
    mathjax: document.querySelectorAll('mjx-container').length,
    mathjax_errors: document.querySelectorAll('mjx-merror').length,
    images: document.querySelectorAll('main img').length,
    broken_images: [...document.querySelectorAll('img')].filter(i => !(i.naturalWidth > 0)).map(i => i.src),
    mathjax_src: [...document.scripts].map(s => s.src).filter(s => s.includes('mathjax')),
    height: Math.ceil(document.documentElement.scrollHeight),
  };
})()"""


def check_page(page: Page, url: str, what: str, math: bool, figure: bool, shot: Path | None) -> list[str]:
    page.events.clear()
    page.send("Page.navigate", url=url)
    page.wait_for("Page.loadEventFired")
    facts = page.evaluate(PAGE_FACTS)
    time.sleep(0.5)                                             # late console messages
    page.evaluate("1")
    problems = page.errors()
    site = "/".join(url.split("/")[:3]) + "/"
    if any(not src.startswith(site) for src in facts["mathjax_src"]) or (facts["math_source"] and not facts["mathjax_src"]):
        problems.append(f"MathJax is not loaded from the site itself: {facts['mathjax_src']}")
    if facts["math_source"] and facts["mathjax"] == 0:
        problems.append(f"{facts['math_source']} math elements but no MathJax output")
    if math and facts["mathjax"] == 0:
        problems.append("no equation typeset by MathJax")
    if facts["mathjax_errors"]:
        problems.append(f"{facts['mathjax_errors']} MathJax errors (mjx-merror)")
    left = [t for t in LEFT_OVER_TEX if t in facts["text"]]
    if left:
        problems.append(f"TeX left in the visible text: {left}")
    if facts["broken_images"]:
        problems.append(f"images that did not load: {facts['broken_images']}")
    if figure and facts["images"] == 0:
        problems.append("no figure on the page")
    if shot is not None:
        height = min(facts["height"], 12000)
        data = page.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": 1280, "height": height, "scale": 1})["data"]
        shot.write_bytes(base64.b64decode(data))
    print(f"{'FAIL' if problems else 'ok  '} {url}: {what}; {facts['mathjax']} equations typeset, "
          f"{facts['images']} images" + (f" -> {shot}" if shot else ""))
    for problem in problems:
        print(f"     {problem}")
    return problems


def debugger_port(profile: Path, process: subprocess.Popen, timeout: float = 30) -> int:
    "The DevTools port Chromium picked (--remote-debugging-port=0 writes it to DevToolsActivePort)."
    deadline = time.monotonic() + timeout
    port_file = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"Chromium exited with code {process.returncode}")
        if port_file.is_file() and port_file.read_text().strip():
            return int(port_file.read_text().split()[0])
        time.sleep(0.1)
    raise TimeoutError("Chromium did not open its DevTools port")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site (_docs)")
    parser.add_argument("--shots", type=Path, help="folder for the PNG screenshots")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"check_site: no site in {args.site} (run `make docs`)", file=sys.stderr)
        return 2
    if not args.chromium:
        print("check_site: Chromium not found (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    if args.shots:
        args.shots.mkdir(parents=True, exist_ok=True)
    server, port = serve(args.site)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        chromium = subprocess.Popen([args.chromium, *FLAGS, f"--user-data-dir={profile}",
                                     "--remote-debugging-port=0", "about:blank"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            devtools = debugger_port(Path(profile), chromium)
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{devtools}/json/list"))
            page = Page(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
            for domain in ("Page", "Runtime", "Log", "Network"):
                page.send(f"{domain}.enable")
            page.send("Emulation.setDeviceMetricsOverride", width=1280, height=1000, deviceScaleFactor=1, mobile=False)
            failures = 0
            for path, what, math, figure in PAGES:
                shot = args.shots / (path.replace("/", "_").removesuffix(".html") + ".png") if args.shots else None
                failures += bool(check_page(page, f"http://127.0.0.1:{port}/{path}", what, math, figure, shot))
            page.ws.close()
        finally:
            chromium.terminate()
            try:
                chromium.wait(10)
            except subprocess.TimeoutExpired:
                chromium.kill()
            server.shutdown()
    print(f"{len(PAGES) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
