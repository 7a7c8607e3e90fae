"""What the Python test drivers and fixtures share: named checks, waits for a state, stopping a
process (a child, or a server by its pid file), and naming a token without showing it."""

import hashlib
import os
import signal
import subprocess
import time

STEP_TIMEOUT = 30
FAILURES = []


def fingerprint(token):
    """A short name for a token or secret (text or bytes): never print the value."""
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()[:8]


def check(condition, what, detail=""):
    """Prints `ok` or `FAIL` with `what`; a failure is counted in FAILURES."""
    print(("ok   " if condition else "FAIL ") + what + ("" if condition or not detail else f"  [{detail}]"), flush=True)
    if not condition:
        FAILURES.append(what)
    return condition


def eventually(condition, timeout=STEP_TIMEOUT, interval=0.1):
    """condition() until it returns something true, or None at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def stop(process, timeout=20):
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def process_argv(pid):
    """The arguments of process `pid`, or None when it is gone or a zombie (a fixture's pid file
    may name a process that has exited, its number since reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except (OSError, IndexError):
        return None


def stop_pid(pid, alive, timeout=5):
    """SIGTERM to `pid` while `alive(pid)` says it is still the process meant, SIGKILL after
    `timeout` seconds; returns once it is gone."""
    if not alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.05)
