"""Debian's Chromium, headless, driven over the DevTools protocol (a websocket, with the `websockets`
package Prefect already installs): open a page, wait for what a person would wait for, click,
type into a field, read the page's text and take screenshots. Enough to walk the Prefect UI as its
users do, with no browser download and no driver."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One browser tab."""

    def __init__(self, socket: Any):
        self.socket = socket
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events that arrive meanwhile are skipped)."""
        number = next(self.ids)
        self.socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        answer = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in answer:
            raise RuntimeError(f"{expression[:80]}: {answer['exceptionDetails'].get('text')}")
        return answer.get("result", {}).get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'", 60, f"{url} to load")

    def wait(self, expression: str, seconds: float, what: str) -> Any:
        """The first true value of `expression`, polled every half second."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):  # the page may be between documents
                value = self.eval(expression)
                if value:
                    return value
            time.sleep(0.5)
        raise AssertionError(f"gave up waiting for {what}; the page says:\n{self.text()[:3000]}")

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def wait_for_text(self, text: str, seconds: float = 60) -> None:
        self.wait(f"document.body && document.body.innerText.includes({json.dumps(text)})", seconds,
                  f"the text {text!r}")

    def click(self, text: str, selector: str = "*", seconds: float = 30) -> None:
        """Click the first visible element matching `selector` whose text is `text` (the innermost
        one: a tab's label, a button's)."""
        script = f"""(() => {{
            const same = e => e.innerText && e.innerText.trim() === {json.dumps(text)};
            const found = [...document.querySelectorAll({json.dumps(selector)})].find(e =>
                same(e) && e.offsetParent !== null && ![...e.children].some(same));
            if (!found) return false;
            found.scrollIntoView({{block: 'center'}}); found.click(); return true;
        }})()"""
        self.wait(script, seconds, f"a {selector} saying {text!r} to click")

    def fill(self, label: str, value: str, nth: int = 0) -> None:
        """Type `value` into the form field labelled `label` (the `nth` such field; an optional
        field's label is read without its "(Optional)"), as a person does: click into it, select
        what it holds, type over it, leave it; then wait until the field holds it."""
        script = (f"(input => {{ if (!input) return false; input.scrollIntoView({{block: 'center'}}); "
                  f"input.focus(); return true; }})({self._field_js(label, nth)})")
        self.wait(script, 30, f"the field {label!r}")
        self._type_over(value)
        self.wait_for_value(label, value, nth, seconds=10)
        self.eval(f"{self._field_js(label, nth)}?.blur()")  # leaving the field commits it, as a person's Tab does

    def type_into(self, selector: str, value: str) -> None:
        """Type `value` over what the first field matching `selector` holds (a search box, which has
        no label), as `fill` does."""
        self.wait(f"(e => e ? (e.focus(), true) : false)(document.querySelector({json.dumps(selector)}))", 30,
                  f"the field {selector}")
        self._type_over(value)

    def _type_over(self, value: str) -> None:
        """Select what the focused field holds (Ctrl-A) and type `value` over it."""
        self.call("Input.dispatchKeyEvent", type="rawKeyDown", key="a", code="KeyA", windowsVirtualKeyCode=65,
                  modifiers=2, commands=["selectAll"])  # Ctrl-A
        self.call("Input.dispatchKeyEvent", type="keyUp", key="a", code="KeyA", windowsVirtualKeyCode=65, modifiers=2)
        self.call("Input.insertText", text=value)

    def wait_for_value(self, label: str, value: str, nth: int = 0, seconds: float = 30) -> None:
        """Wait until the form field labelled `label` holds `value`."""
        self.wait(f"{self._field_js(label, nth)}?.value === {json.dumps(value)}", seconds,
                  f"{label!r} to hold {value!r}")

    @staticmethod
    def _field_js(label: str, nth: int) -> str:
        """A JavaScript expression for the input of the form field labelled `label` (or undefined)."""
        return f"""(() => {{
            const labels = [...document.querySelectorAll('.schema-form-property__label, label')]
                .filter(l => l.innerText.trim().replace(/ [(]Optional[)]$/, '') === {json.dumps(label)});
            const field = labels[{nth}] && labels[{nth}].closest('.schema-form-property, .p-label');
            return (field && field.querySelector('input, textarea')) || undefined;
        }})()"""

    def value(self, label: str, nth: int = 0) -> str | None:
        """What the form field labelled `label` holds."""
        return self.eval(f"{self._field_js(label, nth)}?.value ?? null")

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 6000),
                                "scale": 1})
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", **params)["data"]))
        return path


@contextlib.contextmanager
def browser(profile: Path, width: int = 1400, height: int = 1000) -> Iterator[Page]:
    """Headless Chromium with its own profile folder; yields its first tab, closed at the end."""
    from websockets.sync.client import connect

    binary = chromium()
    assert binary, "Debian's chromium is not installed"
    profile.mkdir(parents=True, exist_ok=True)
    port_file = profile / "DevToolsActivePort"
    port_file.unlink(missing_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "about:blank"]
    with subprocess.Popen([binary, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        try:
            deadline = time.monotonic() + 60
            while not (port_file.is_file() and len(port_file.read_text().split()) == 2):
                assert proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
                time.sleep(0.2)
            port = port_file.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
                tabs = [t for t in json.load(answer) if t["type"] == "page"]
            with connect(tabs[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as socket:
                page = Page(socket)
                page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                          mobile=False)
                yield page
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
