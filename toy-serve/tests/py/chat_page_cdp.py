"""The chat page at `/` in headless Chromium, driven over the DevTools protocol.

Usage: chat_page_cdp.py BASE_URL API_KEY MESSAGE MAX_TOKENS EXPECTED_REPLY_FILE
Loads the page, types the API key and a message, clicks Send, and watches the reply grow chunk by
chunk until the page says it is done. The reply must equal the file's text (greedy decoding:
the page is set to temperature 0). Exit status 1 with the reason on failure.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from websockets.sync.client import connect

base, key, message, max_tokens, expected_file = sys.argv[1:6]
expected = open(expected_file, encoding="utf-8").read()

chromium = shutil.which("chromium") or shutil.which("chromium-browser")
if not chromium:
    sys.exit("chromium is missing: run scripts/serve-test-deps.sh (apt-get install chromium)")

profile = tempfile.mkdtemp(prefix="toy-chromium-")
proc = subprocess.Popen(
    [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
     "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
     f"--user-data-dir={profile}", "about:blank"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)


class Cdp:
    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")


def wait(what, fn, timeout):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


try:
    port_file = os.path.join(profile, "DevToolsActivePort")
    wait("chromium's DevTools port", lambda: os.path.exists(port_file) and open(port_file).read().strip(), 60)
    port = int(open(port_file).read().split()[0])
    targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
    page = next(t for t in targets if t["type"] == "page")
    with connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
        cdp = Cdp(ws)
        cdp.call("Runtime.enable")
        cdp.call("Page.enable")
        cdp.call("Page.navigate", url=base + "/")
        wait("the page", lambda: cdp.eval("document.readyState === 'complete' && !!document.getElementById('send')"), 30)
        title = cdp.eval("document.title")
        assert title == "toy chat", f"title {title!r}"
        # Settings, as a user would set them; the key makes /v1/models answer.
        cdp.eval(f"""(() => {{
            const k = document.getElementById('key'); k.value = {json.dumps(key)};
            k.dispatchEvent(new Event('change'));
            document.getElementById('temperature').value = '0';
            document.getElementById('max_tokens').value = {json.dumps(max_tokens)};
        }})()""")
        wait("the model name on the page", lambda: "context" in (cdp.eval("document.getElementById('model').textContent") or ""), 30)
        # Type the message and press Enter.
        cdp.eval("document.getElementById('input').focus()")
        cdp.call("Input.insertText", text=message)
        for kind in ("keyDown", "keyUp"):
            cdp.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                     windowsVirtualKeyCode=13, nativeVirtualKeyCode=13, **({"text": "\r"} if kind == "keyDown" else {}))
        # Watch the reply: it must be seen part-way (streaming), then complete.
        seen = set()
        probe = """(() => { const m = document.querySelectorAll('.msg');
            const last = m[m.length - 1];
            return [document.body.dataset.state, last ? last.className : '', last ? last.textContent : '',
                    last ? Number(last.dataset.chunks || 0) : 0, m.length]; })()"""
        end = time.time() + 120
        while time.time() < end:
            state, cls, text, chunks, count = cdp.eval(probe)
            if state == "streaming" and text:
                seen.add(text)
            if state in ("done", "error"):
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the reply never finished")
        assert state == "done", f"page state {state}: {text}"
        assert count == 2 and "assistant" in cls, f"{count} messages, last {cls}"
        user = cdp.eval("document.querySelector('.msg.user').textContent")
        assert user == message, f"user message shown as {user!r}"
        assert text == expected, f"reply {text!r} != expected {expected!r}"
        assert chunks > 1, f"reply arrived in {chunks} chunk(s)"
        partial = [s for s in seen if s != text]
        assert partial, "no partial reply was ever visible: not streamed"
        print(json.dumps({"chunks": chunks, "partial_views": len(partial), "reply": text}))
finally:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(profile, ignore_errors=True)
