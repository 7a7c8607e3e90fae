"""What the client's test modules share: naming a token without showing it, waiting for a
state with a deadline, a Broker that counts its recoveries, and the stack of dev-issuer and
the daemon started from the build directory in $TOKENBROKER_BIN."""

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

from tokenbroker import Broker

BIN = os.environ.get("TOKENBROKER_BIN", "")


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


class CountingBroker(Broker):
    """A Broker that counts the recoveries it asks for: Recover calls, and GetProof calls with a
    rejected token (which answer as Recover does; the broker's metrics count GetProof calls
    all together)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recoveries = 0

    def call(self, method, parameters=None):
        if method == "Recover" or (method == "GetProof" and (parameters or {}).get("rejected")):
            self.recoveries += 1
        return super().call(method, parameters)


class Stack:
    """dev-issuer + tokenbroker serve with session `api`, logged in.

    With `dpop` ("accepted" or "required"), dev-issuer takes DPoP proofs (with `nonces`, it
    and its resource demand server nonces too) and `api` is a DPoP session (DPoP=yes), whose
    first refresh binds the login's refresh token family to the daemon's key; `serves` gives
    `api` a Serves= entry; `keys`, resources its callers may narrow its token to (and scope read); `authorization`, dev-issuer's authorization endpoint (code logins)."""

    def __init__(self, slow=False, dpop=None, nonces=False, serves=None, authorization=False, keys=None):
        if not BIN or not os.path.exists(os.path.join(BIN, "tokenbroker")):
            pytest.skip("TOKENBROKER_BIN does not hold a build (run through make python-test)")
        self.directory = tempfile.mkdtemp(prefix="tb-py-")
        # Readable by its owner only: the daemon refuses a secret file every user may read.
        with open(os.open(os.path.join(self.directory, "client-secret"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write("dev-secret\n")
        arguments = [os.path.join(BIN, "dev-issuer"), "--client-secret-file", self.directory + "/client-secret",
                     "--refresh-token-file", self.directory + "/refresh-token"]
        if dpop:
            arguments += ["--dpop", dpop]
        if nonces:
            arguments.append("--dpop-nonces")
        self.issuer = subprocess.Popen(arguments, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.base = self.issuer.stdout.readline().split()[1]
        self.config = os.path.join(self.directory, "tokenbroker.conf")
        with open(self.config, "w") as f:
            f.write(f"[Broker]\nSocketMode=0600\n\n[Session]\nName=api\nTokenEndpoint={self.base}/token\n"
                    f"RevocationEndpoint={self.base}/revoke\nClientID=tokenbroker\nClientSecretFile={self.directory}/client-secret\n"
                    "RefreshLimitBurst=1000\n")
            if dpop:
                f.write("DPoP=yes\n")
            if serves:
                f.write(f"Serves={serves}\n")
            if keys:
                # Keys per call: these resources, and the scope word read.
                f.write(f"AllowResources={' '.join(keys)}\nAllowScopes=read\n")
            if authorization:
                f.write(f"AuthorizationEndpoint={self.base}/authorize\nScope=openid\n")
            if slow:
                # A token endpoint that accepts connections and never answers.
                self.blackhole = socket.socket()
                self.blackhole.bind(("127.0.0.1", 0))
                self.blackhole.listen(16)
                f.write(f"\n[Session]\nName=slow\nTokenEndpoint=http://127.0.0.1:{self.blackhole.getsockname()[1]}/token\n"
                        f"ClientID=tokenbroker\nClientSecretFile={self.directory}/client-secret\nRequestTimeout=3s\n")
        self.socket = os.path.join(self.directory, "broker.sock")
        self.start()
        eventually("the refresh token file", lambda: os.path.exists(self.directory + "/refresh-token"))
        with open(self.directory + "/refresh-token") as f:
            Broker(self.socket).call("Login", {"session": "api", "refreshToken": f.read().strip()})
        Broker(self.socket).token("api")   # the first token (the login brought a refresh token only)

    def start(self):
        self.daemon = subprocess.Popen([os.path.join(BIN, "tokenbroker"), "serve", "--config", self.config, "--socket", self.socket,
                                        "--state-dir", self.directory + "/state"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually("the broker's socket", lambda: self._listening() or self.daemon.poll() is not None)
        assert self.daemon.poll() is None, f"the daemon exited with {self.daemon.returncode}"

    def _listening(self):
        """Whether the broker's socket takes connections (it may be there a moment before)."""
        if not os.path.exists(self.socket):
            return False
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def restart(self):
        self.daemon.send_signal(signal.SIGTERM)
        self.daemon.wait(timeout=30)
        self.start()

    def counters(self):
        with urllib.request.urlopen(self.base + "/_dev/counters", timeout=5) as answer:
            return json.load(answer)

    def revoke(self, token):
        """Revokes an access token at the issuer: the resource then answers 401 invalid_token."""
        body = f"token={urllib.parse.quote(token, safe='')}&token_type_hint=access_token".encode()
        request = urllib.request.Request(self.base + "/revoke", data=body, method="POST",
                                         headers={"Authorization": "Basic " + base64.b64encode(b"tokenbroker:dev-secret").decode(),
                                                  "Content-Type": "application/x-www-form-urlencoded"})
        urllib.request.urlopen(request, timeout=5).read()

    def stop(self):
        for process in (self.daemon, self.issuer):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
