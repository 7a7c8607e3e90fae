#!/usr/bin/env python3
"""tokenbroker against a real authorization server nobody here wrote: Glewlwyd (Debian).

    glewlwyd.py BIN_DIR

BIN_DIR holds `tokenbroker` and `tokenbroker-daemon`. The Glewlwyd fixture
(glewlwyd_fixture.py, beside this file) installs the package if it is missing, starts it on
127.0.0.1 with a SQLite database in a temporary directory and provisions it through its admin
API. The daemon runs as the current user with its own socket, state directory and configuration.

Checks: login and refresh with rotation (client_secret_post and client_secret_basic), a storm of
worker processes -> one refresh, discovery, client_credentials, logout revoking upstream, a
refresh token revoked at the server -> the session ends after a bounded number of requests,
short-lived tokens under the default RefreshAhead= -> no Throttled and at most one refresh per
half lifetime, and the journal line of each outcome. Exit 0 when every check passed, 1 when
one failed, 0 with a SKIP line when Glewlwyd cannot be installed here. No token is printed:
tokens are named by a short fingerprint.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "glewlwyd_fixture.py")
sys.path.insert(0, os.path.join(HERE, "..", "PyCommon"))
from checks import FAILURES, STEP_TIMEOUT, check, eventually, fingerprint, stop  # noqa: E402


class Fixture:
    """The Glewlwyd server, through glewlwyd_fixture.py."""

    def __init__(self, directory, access_token_duration):
        self.directory = directory
        out = subprocess.run([sys.executable, FIXTURE, "up", "--dir", directory,
                              "--access-token-duration", str(access_token_duration)],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"glewlwyd did not come up: {out.stderr[-2000:]}")
        self.info = json.loads(out.stdout)

    def refresh_token(self, client):
        out = subprocess.run([sys.executable, FIXTURE, "refresh-token", "--dir", self.directory, "--client", client],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"no refresh token from glewlwyd: {out.stderr[-1000:]}")
        return out.stdout.strip()

    def secret(self, client):
        with open(self.client(client)["client_secret_file"]) as f:
            return f.read().strip()

    def client(self, client):
        return next(c for c in self.info["clients"] if c["client_id"] == client)

    def post(self, url, fields):
        """A form POST with the post client's credentials: the HTTP status (no body is kept)."""
        body = urllib.parse.urlencode(dict(fields, client_id="postclient", client_secret=self.secret("postclient"))).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    def revoke(self, token):
        """RFC 7009, as the post client."""
        return self.post(self.info["revocation_endpoint"], {"token": token, "token_type_hint": "refresh_token"}) == 200

    def refresh_works(self, token):
        """Whether Glewlwyd still accepts `token` for a refresh (and spends it if so)."""
        return self.post(self.info["token_endpoint"], {"grant_type": "refresh_token", "refresh_token": token}) == 200

    def down(self):
        subprocess.run([sys.executable, FIXTURE, "down", "--dir", self.directory], capture_output=True, timeout=60)


class Daemon:
    def __init__(self, bin_dir, directory, config):
        self.bin_dir = bin_dir
        self.directory = directory
        os.makedirs(directory, mode=0o700)
        self.socket = os.path.join(directory, "tb.sock")
        self.config = os.path.join(directory, "tb.conf")
        with open(self.config, "w") as f:
            f.write(config)
        self.log_path = os.path.join(directory, "daemon.log")
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([os.path.join(bin_dir, "tokenbroker"), "serve", "--config", self.config,
                                         "--socket", self.socket, "--state-dir", os.path.join(directory, "state")],
                                        stdout=subprocess.DEVNULL, stderr=self.log)
        if not eventually(lambda: os.path.exists(self.socket) or self.process.poll() is not None, timeout=20, interval=0.05) \
                or self.process.poll() is not None:
            raise RuntimeError(f"the daemon did not start: {self.journal()[-2000:]}")

    def ctl(self, *arguments, stdin=None):
        return subprocess.run([os.path.join(self.bin_dir, "tokenbroker"), "ctl", "--socket", self.socket, *arguments],
                              input=stdin, capture_output=True, text=True, timeout=STEP_TIMEOUT)

    def status(self, session):
        out = self.ctl("--json", "status")
        if out.returncode != 0:
            return {}
        for entry in json.loads(out.stdout).get("sessions", []):
            if entry.get("name") == session:
                return entry
        return {}

    def journal(self):
        with open(self.log_path) as f:
            return f.read()

    def lines(self, text):
        return [line for line in self.journal().splitlines() if text in line]

    def stop(self):
        stop(self.process)
        self.log.close()


def session(name, client, auth, **extra):
    lines = ["[Session]", f"Name={name}", f"ClientID={client['client_id']}", f"ClientSecretFile={client['client_secret_file']}",
             f"ClientAuthentication={auth}"]
    lines += [f"{key}={value}" for key, value in extra.items()]
    return "\n".join(lines) + "\n\n"


def main():
    bin_dir = sys.argv[1]
    top = tempfile.mkdtemp(prefix="tb-glewlwyd-")
    servers = []
    daemons = []
    secrets_seen = []
    started = time.monotonic()
    try:
        try:
            server = Fixture(os.path.join(top, "glewlwyd"), 3600)
        except RuntimeError as error:
            if not shutil.which("glewlwyd"):
                print(f"SKIP glewlwyd cannot be installed here: {str(error)[-300:]}")
                return 0
            raise
        servers.append(server)
        info = server.info
        clients = {"post": server.client("postclient"), "basic": server.client("basicclient")}
        secrets_seen += [server.secret("postclient"), server.secret("basicclient")]
        endpoints = {"TokenEndpoint": info["token_endpoint"], "RevocationEndpoint": info["revocation_endpoint"]}
        config = "[Broker]\nSocketMode=0600\n\n"
        config += session("glwd-post", clients["post"], "client_secret_post", **endpoints)
        config += session("glwd-basic", clients["basic"], "client_secret_basic", **endpoints)
        config += session("glwd-disc", clients["post"], "client_secret_post", Issuer=info["issuer"])
        config += session("glwd-cc", clients["post"], "client_secret_post", Grant="client_credentials", Scope="api", **endpoints)
        config += session("glwd-dead", clients["post"], "client_secret_post", **endpoints)
        config += session("glwd-out", clients["basic"], "client_secret_basic", **endpoints)
        config += session("glwd-device", clients["post"], "client_secret_post", Scope="api",
                          DeviceAuthorizationEndpoint=info["device_authorization_endpoint"], **endpoints)
        daemon = Daemon(bin_dir, os.path.join(top, "daemon"), config)
        daemons.append(daemon)

        # -- Login and refresh with rotation, both client authentications ---------------------
        for name, kind in (("glwd-post", "post"), ("glwd-basic", "basic"), ("glwd-disc", "post")):
            refresh = server.refresh_token(clients[kind]["client_id"])
            secrets_seen.append(refresh)
            login = daemon.ctl("login", name, "--refresh-token-stdin", stdin=refresh + "\n")
            check(login.returncode == 0, f"{name}: login with a refresh token from Glewlwyd's password grant", login.stderr.strip())
            first = daemon.ctl("token", name)
            check(first.returncode == 0 and first.stdout.strip(), f"{name}: a token", first.stderr.strip())
            forced = daemon.ctl("refresh", name)
            second = daemon.ctl("token", name)
            secrets_seen += [first.stdout.strip(), second.stdout.strip()]
            check(forced.returncode == 0 and second.returncode == 0 and second.stdout.strip() != first.stdout.strip(),
                  f"{name}: a forced refresh rotates (token {fingerprint(first.stdout.strip())} -> {fingerprint(second.stdout.strip())})",
                  forced.stderr.strip())

        # -- A storm: 20 worker processes present the same old token at once -------------------
        old = daemon.ctl("token", "glwd-post").stdout.strip()
        before = len(daemon.lines("session glwd-post: refreshed"))
        workers = [subprocess.Popen([os.path.join(bin_dir, "tokenbroker"), "ctl", "--socket", daemon.socket, "recover", "glwd-post"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for _ in range(20)]
        results = [worker.communicate(old + "\n", timeout=STEP_TIMEOUT) for worker in workers]
        tokens = {out.strip() for out, _ in results}
        secrets_seen += list(tokens) + [old]
        refreshed = len(daemon.lines("session glwd-post: refreshed")) - before
        check(all(worker.returncode == 0 for worker in workers) and len(tokens) == 1 and old not in tokens,
              "storm: 20 processes recovering the same old token all get the same new one",
              f"{len(tokens)} distinct, exits {[w.returncode for w in workers]}")
        check(refreshed == 1, f"storm: one refresh at Glewlwyd ({refreshed})")

        # -- Device login: ctl prints the code, the user approves it at Glewlwyd (its REST API,
        # as the browser would), ctl returns once the daemon holds the grant's tokens.
        login = subprocess.Popen([os.path.join(bin_dir, "tokenbroker"), "ctl", "--socket", daemon.socket, "login", "glwd-device"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        code = None
        deadline = time.monotonic() + STEP_TIMEOUT
        while code is None and time.monotonic() < deadline:
            line = login.stdout.readline()
            if not line:
                break
            if "enter the code " in line:
                code = line.rsplit("enter the code ", 1)[1].strip()
        approved = code is not None and subprocess.run([sys.executable, FIXTURE, "approve-device", "--dir", server.directory,
                                                        "--user-code", code], capture_output=True, timeout=60).returncode == 0
        check(approved, "glwd-device: ctl login prints a user code, approved at Glewlwyd")
        try:
            login.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            login.kill()
            login.wait()
        device_token = daemon.ctl("token", "glwd-device")
        check(login.returncode == 0 and device_token.returncode == 0 and device_token.stdout.strip(),
              "glwd-device: the device login completes and the session serves a token", login.stderr.read().strip()[:200])

        # -- client_credentials and discovery ---------------------------------------------------
        cc = daemon.ctl("token", "glwd-cc")
        check(cc.returncode == 0 and cc.stdout.strip(), "glwd-cc: client_credentials needs no login", cc.stderr.strip())

        # -- Logout revokes upstream: logged in, never refreshed, logged out -> the refresh token
        # it held is dead at Glewlwyd.
        held = server.refresh_token("basicclient")
        secrets_seen.append(held)
        daemon.ctl("login", "glwd-out", "--refresh-token-stdin", stdin=held + "\n")
        logout = daemon.ctl("logout", "glwd-out")
        check(logout.returncode == 0, "glwd-out: logout", logout.stderr.strip())
        said = eventually(lambda: daemon.lines("session glwd-out: the refresh token retired by the logout is revoked upstream"), timeout=10)
        check(bool(said), "glwd-out: the revocation at logout is logged")
        check(not server.refresh_works(held), "glwd-out: the refresh token it held is refused by Glewlwyd after the logout")

        # -- A refresh token revoked at the server: the session ends, boundedly -----------------
        dead = server.refresh_token("postclient")
        secrets_seen.append(dead)
        login = daemon.ctl("login", "glwd-dead", "--refresh-token-stdin", stdin=dead + "\n")
        check(login.returncode == 0, "glwd-dead: login", login.stderr.strip())
        check(server.revoke(dead), "glwd-dead: the refresh token is revoked at Glewlwyd (RFC 7009)")
        ended = eventually(lambda: (daemon.ctl("token", "glwd-dead"), daemon.status("glwd-dead").get("state") == "ended")[1], timeout=30)
        status = daemon.status("glwd-dead")
        check(bool(ended), "glwd-dead: the session ends (state ended)", json.dumps({k: status.get(k) for k in ("state", "lastError")}))
        check("log in again" in (status.get("lastError") or "") or "ctl login" in (status.get("lastError") or ""),
              "glwd-dead: its reason tells the operator to log in again")
        failures = daemon.lines("session glwd-dead: refresh failed (refused)")
        check(len(failures) == 2 and len(daemon.lines("session glwd-dead: ended")) == 1,
              f"glwd-dead: the dead token went out 3 times: 2 refusals at warning, the end at error ({len(failures)} refusals)")
        daemon.stop()
        daemons.remove(daemon)
        journals = [daemon.journal()]

        # -- Short-lived tokens under the default RefreshAhead= ---------------------------------
        short = Fixture(os.path.join(top, "glewlwyd-short"), 4)
        servers.append(short)
        sinfo = short.info
        client = short.client("postclient")
        secrets_seen.append(short.secret("postclient"))
        daemon = Daemon(bin_dir, os.path.join(top, "daemon-short"),
                        "[Broker]\nSocketMode=0600\n\n" + session("glwd-short", client, "client_secret_post",
                                                                 TokenEndpoint=sinfo["token_endpoint"]))
        daemons.append(daemon)
        refresh = short.refresh_token("postclient")
        secrets_seen.append(refresh)
        daemon.ctl("login", "glwd-short", "--refresh-token-stdin", stdin=refresh + "\n")
        calls, failed = 0, []
        end = time.monotonic() + 8
        while time.monotonic() < end:
            out = daemon.ctl("token", "glwd-short")
            calls += 1
            if out.returncode != 0:
                failed.append(out.stderr.strip()[:80])
            time.sleep(0.25)
        refreshes = len(daemon.lines("session glwd-short: refreshed"))
        check(not failed, f"glwd-short: 4 s tokens, one ctl token every 250 ms for 8 s: no failure ({calls} calls)", "; ".join(set(failed)))
        check(refreshes <= 5, f"glwd-short: at most one refresh per half lifetime ({refreshes} in 8 s)")
        check(not daemon.lines("refresh limit reached"), "glwd-short: never throttled")

        # -- The journal: outcomes, and never a secret -------------------------------------------
        for text in journals + [daemon.journal()]:
            leaked = [fingerprint(s) for s in secrets_seen if s and s in text]
            check(not leaked, "no client secret, refresh token or access token in the daemon's log", ",".join(leaked))
        check(bool(daemon.lines("refreshed, token #")), "refreshes are logged with the token's serial and lifetime")
    finally:
        for d in daemons:
            d.stop()
        for s in servers:
            s.down()
        subprocess.run(["rm", "-rf", top])
    print(f"glewlwyd interop: {len(FAILURES)} failure(s), {time.monotonic() - started:.1f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
