"""Headless Chromium driven over the DevTools protocol (its WebSocket spoken with the standard library): the
page tests type into a page, press keys, read the DOM and take screenshots."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest


class Browser:
    """One headless Chromium with one page at ``url``."""

    def __init__(self, url: str, profile, width: int = 1200, height: int = 800):
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if binary is None:
            pytest.skip("Chromium is not installed (apt-get install chromium); .ci/run installs it")
        self.process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
             "--disable-background-networking", "--disable-component-update", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "--remote-debugging-port=0", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        address = None
        for line in self.process.stderr:  # Chromium names its DevTools address once it listens
            found = re.search(r"DevTools listening on (ws://\S+)", line)
            if found:
                address = urllib.parse.urlparse(found[1])
                break
        assert address is not None, "Chromium exited without opening DevTools"
        threading.Thread(target=self.process.stderr.read, daemon=True).start()  # a full pipe would stall it
        targets = json.loads(urllib.request.urlopen(f"http://{address.netloc}/json/list", timeout=30).read())
        page = next(t for t in targets if t["type"] == "page")
        self.socket = _WebSocket(page["webSocketDebuggerUrl"])
        self.calls = 0
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params) -> dict:
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.receive())
            if message.get("id") == self.calls:
                assert "error" not in message, message["error"]
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, limit_s: float = 300.0):
        """Polls until ``expression`` is truthy; the limit only turns a broken page into a failure."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"the page never gave {expression}")

    def type(self, text: str) -> None:
        self.call("Input.insertText", text=text)

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                      **({"text": "\r"} if kind == "keyDown" else {}))

    def choose_file(self, selector: str, path) -> None:
        """As if the file were picked in the file input at ``selector`` (its change event fires)."""
        root = self.call("DOM.getDocument")["root"]["nodeId"]
        node = self.call("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        self.call("DOM.setFileInputFiles", files=[str(path)], nodeId=node)

    def screenshot(self, path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


class _WebSocket:
    """Text frames over one connection (RFC 6455): what the DevTools protocol needs."""

    def __init__(self, url: str):
        parts = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=120)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        assert b" 101 " in head.split(b"\r\n")[0], head

    def send(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        n = len(payload)
        length = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big") if n < 65536 else \
            bytes([0x80 | 127]) + n.to_bytes(8, "big")
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(bytes([0x81]) + length + mask + masked)

    def receive(self) -> str:
        data = b""
        while True:
            first, second = self._take(2)
            n = second & 0x7F
            if n == 126:
                n = int.from_bytes(self._take(2), "big")
            elif n == 127:
                n = int.from_bytes(self._take(8), "big")
            data += self._take(n)
            if first & 0x80:  # the last fragment
                return data.decode()

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self.buffer += self._recv()
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("DevTools closed the connection")
        return chunk
