"""What the Python test drivers share: named checks, waits for a state, stopping a process,
and naming a token without showing it."""

import hashlib
import signal
import subprocess
import time

STEP_TIMEOUT = 30
FAILURES = []


def fingerprint(token):
    """A short name for a token or secret: never print the value."""
    return hashlib.sha256(token.encode()).hexdigest()[:8]


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
