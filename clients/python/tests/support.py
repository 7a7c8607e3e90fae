"""What the client's test modules share: naming a token without showing it, and waiting for a
state with a deadline."""

import hashlib
import time


def fingerprint(secret):
    """A short name for a token or secret ("-" for none): never print the value."""
    return hashlib.sha256(secret.encode()).hexdigest()[:8] if secret else "-"


def eventually(what, check, timeout=20.0):
    """Polls `check` until it is true; fails naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
