"""`tokenbroker ctl login --flow=code` in a real terminal (a pty): the QR code it draws is read
back and decoded by zxing-cpp (PyPI `zxing-cpp`, a decoder we did not write) to exactly the
printed authorization URL; the login then completes through the daemon's listener, driven by
Python's own HTTP client as the browser. Off a terminal, no QR code is drawn.

No code or token is printed: failures name them by a short fingerprint.
"""

import fcntl
import http.client
import os
import pty
import select
import struct
import subprocess
import termios
import time
import urllib.parse

import numpy
import pytest
import zxingcpp

from support import BIN, Stack, fingerprint
from tokenbroker import Broker

STEP = 20.0


@pytest.fixture
def stack():
    stack = Stack(authorization=True)
    yield stack
    stack.stop()


def read_until(fd, marker, timeout=STEP):
    """What the terminal shows until `marker` (pty line ends normalized)."""
    deadline = time.monotonic() + timeout
    output = b""
    while marker.encode() not in output:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {marker!r} ({len(output)} bytes read)"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
    return output.decode().replace("\r\n", "\n")


def modules(drawing):
    """The QR drawing's rows of modules, light True: each character is two rows."""
    halves = {"█": (True, True), "▀": (True, False), "▄": (False, True), " ": (False, False)}
    rows = []
    for line in drawing:
        top, bottom = zip(*(halves[character] for character in line))
        rows += [list(top), list(bottom)]
    return rows


def decode(rows, scale=4):
    """zxing-cpp's reading of the modules drawn `scale` pixels wide, light on dark as drawn."""
    image = numpy.kron(numpy.array(rows, dtype=numpy.uint8) * 255, numpy.ones((scale, scale), dtype=numpy.uint8))
    # A light border around it all, as a screen around a terminal would be.
    image = numpy.pad(image, 4 * scale, constant_values=255)
    return [result.text for result in zxingcpp.read_barcodes(image)]


def get(url):
    """One GET, redirects not followed: (status, Location, body)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=STEP)
    try:
        connection.request("GET", parts.path + ("?" + parts.query if parts.query else ""))
        answer = connection.getresponse()
        return answer.status, answer.getheader("Location"), answer.read().decode()
    finally:
        connection.close()


def terminal(columns, rows=100):
    """A pty `columns` wide and `rows` high: (primary, secondary). (ctl draws a code only when it
    fits with the rest of the prompt: a code of 69 modules and its text take about 50 rows.)"""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    return primary, secondary


def test_on_a_terminal_the_qr_code_decodes_to_the_printed_url_and_the_login_completes_through_the_listener(stack):
    primary, secondary = terminal(200)
    login = subprocess.Popen([os.path.join(BIN, "tokenbroker"), "ctl", "--socket", stack.socket, "login", "api", "--flow=code"],
                             stdin=secondary, stdout=secondary, stderr=subprocess.PIPE)
    os.close(secondary)
    try:
        shown = read_until(primary, "Waiting for the login")
        lines = shown.split("\n")
        url = next(line[2:] for line in lines if line.startswith("  http"))
        assert url.startswith(stack.base + "/authorize?"), fingerprint(url)
        drawing = [line for line in lines if line and set(line) <= set("█▀▄ ") and "█" in line]
        assert len(drawing) >= 12, f"a QR code is drawn ({len(drawing)} lines)"
        assert len({len(line) for line in drawing}) == 1, "every line of it is as wide"
        assert decode(modules(drawing)) == [url], "zxing-cpp reads the printed URL from the drawing"

        status, location, _ = get(url)
        assert status == 302 and location, f"the issuer redirects the browser (HTTP {status})"
        status, _, page = get(location)
        assert status == 200 and "api is logged in" in page, f"the listener's page (HTTP {status})"
        assert login.wait(timeout=STEP) == 0, login.stderr.read().decode()[:300]
        assert "logged in api (generation 2)" in read_until(primary, "generation 2")
    finally:
        if login.poll() is None:
            login.kill()
            login.wait()
        os.close(primary)
    assert Broker(stack.socket).token("api")


def test_a_terminal_too_narrow_for_the_code_gets_a_note_instead(stack):
    primary, secondary = terminal(40)
    login = subprocess.Popen([os.path.join(BIN, "tokenbroker"), "ctl", "--socket", stack.socket, "login", "api", "--flow=code"],
                             stdin=secondary, stdout=secondary, stderr=subprocess.DEVNULL)
    os.close(secondary)
    try:
        shown = read_until(primary, "Waiting for the login")
        assert "█" not in shown
        assert "rows would show this address as a QR code" in shown
    finally:
        login.kill()
        login.wait()
        os.close(primary)


def test_off_a_terminal_no_qr_code_is_drawn(stack):
    login = subprocess.Popen([os.path.join(BIN, "tokenbroker"), "ctl", "--socket", stack.socket, "login", "api", "--flow=code"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        shown = ""
        deadline = time.monotonic() + STEP
        while "Waiting for the login" not in shown and time.monotonic() < deadline:
            shown += login.stdout.readline()
        assert "Waiting for the login" in shown
        assert "█" not in shown and "▀" not in shown
    finally:
        login.kill()
        login.wait()
