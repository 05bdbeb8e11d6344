#!/usr/bin/env python3
"""Drives specee's chat page (served at `/`) in a real headless Chromium, for the server's integration tests.

Chromium is controlled over the DevTools protocol through `--remote-debugging-pipe` (commands on fd 3, replies
on fd 4, NUL-separated JSON), so nothing beyond Python's standard library and Debian's `chromium` is needed.

    browser_chat.py BASE_URL send MESSAGE [--mode M] [--max-tokens N] [--screenshot FILE]
        loads the page, sends MESSAGE, waits for the streamed answer, prints one JSON object: the answer text the
        page kept, its token spans (text, source, layers) and the page's stats line.
    browser_chat.py BASE_URL close-mid-stream MESSAGE [--max-tokens N]
        sends MESSAGE and closes the tab as soon as the first answer tokens appear; prints {"closed": true, ...}.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1100,1150", "--hide-scrollbars",
]


class Browser:
    def __init__(self):
        exe = os.environ.get("SPECEE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
        if not exe:
            raise SystemExit("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
        self.profile = tempfile.mkdtemp(prefix="specee-chromium-")
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()
        # The child sees our pipe ends as fds 3 (its input) and 4 (its output).
        def child_fds():
            # Copies first: a pipe end may itself be fd 3 or 4 (and dup2 onto itself keeps close-on-exec).
            r, w = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(r, 3)
            os.dup2(w, 4)
        self.proc = subprocess.Popen(
            [exe, *CHROMIUM_FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self.profile}", "about:blank"],
            close_fds=False, preexec_fn=child_fds,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.next_id = 0
        self.buffer = b""
        self.session = None

    def call(self, method, params=None, session=True, timeout=30):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buffer += chunk
        raise TimeoutError(method)

    def open(self, url):
        target = self.call("Target.createTarget", {"url": url}, session=False)["targetId"]
        self.target = target
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)[
            "sessionId"]

    def eval(self, expression):
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"timed out waiting for {what}")

    def close(self):
        try:
            self.call("Browser.close", session=False, timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


SEND = """(() => {
  const mode = %s;
  if (mode) document.getElementById('mode').value = mode;
  document.getElementById('max-tokens').value = %d;
  document.getElementById('input').value = %s;
  document.getElementById('form').requestSubmit();
  return true;
})()"""

RESULT = """(() => {
  const div = [...document.querySelectorAll('.msg.assistant')].pop();
  const spans = [...div.querySelectorAll('.tok')];
  return {
    content: div.dataset.content,
    tokens: Number(div.dataset.tokens),
    error: div.classList.contains('error') ? div.querySelector('.body').textContent : null,
    spans: spans.map(s => ({text: s.textContent, source: s.dataset.source, layers: Number(s.dataset.layers)})),
    stats: (div.querySelector('.stats') || {}).textContent || '',
  };
})()"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("action", choices=["send", "close-mid-stream"])
    ap.add_argument("message")
    ap.add_argument("--mode", default="")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--screenshot")
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args()
    browser = Browser()
    try:
        browser.call("Target.setDiscoverTargets", {"discover": False}, session=False)
        browser.open(a.base_url + "/")
        browser.wait_for("document.querySelectorAll('#mode option').length > 1", 30, "the page to list the modes")
        browser.eval(SEND % (json.dumps(a.mode), a.max_tokens, json.dumps(a.message)))
        if a.action == "close-mid-stream":
            browser.wait_for("document.querySelectorAll('.msg.assistant .tok').length > 0", a.timeout,
                             "the first answer tokens")
            shown = browser.eval("document.querySelectorAll('.msg.assistant .tok').length")
            browser.call("Target.closeTarget", {"targetId": browser.target}, session=False)
            print(json.dumps({"closed": True, "tokens_shown": shown}))
            return
        browser.wait_for("document.querySelector('.msg.assistant[data-done]') !== null", a.timeout, "the answer")
        result = browser.eval(RESULT)
        if a.screenshot:
            import base64
            shot = browser.call("Page.captureScreenshot", {"format": "png"})
            with open(a.screenshot, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
        print(json.dumps(result))
    finally:
        browser.close()


if __name__ == "__main__":
    sys.exit(main())
