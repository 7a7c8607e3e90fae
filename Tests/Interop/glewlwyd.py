#!/usr/bin/env python3
"""tokenbroker against a real authorization server nobody here wrote: Glewlwyd (Debian).

    glewlwyd.py BIN_DIR

BIN_DIR holds `tokenbroker` and `tokenbroker-daemon`. The Glewlwyd fixture
(glewlwyd_fixture.py, beside this file) installs the package if it is missing, starts it on
127.0.0.1 with a SQLite database in a temporary directory and provisions it through its admin
API. The daemon runs as the current user with its own socket, state directory and configuration.

Checks: login and refresh with rotation (client_secret_post and client_secret_basic), a storm of
worker processes -> one refresh, discovery, the device flow, the authorization code flow with PKCE
(`ctl login --flow=code`: the fixture plays the browser; the redirect reaches the daemon's
loopback listener, or is pasted into ctl; Glewlwyd's records of the code, its S256 challenge and
nonce; Glewlwyd refusing a request without PKCE), client_credentials, logout revoking upstream, a
refresh token revoked at the server -> the session ends after a bounded number of requests,
short-lived tokens under the default RefreshAhead= -> no Throttled and at most one refresh per
half lifetime, the journal line of each outcome, and DPoP (RFC 9449; what Glewlwyd 2.7.5 does
with it is written at that section): device logins bound to the daemon's key (token_type DPoP,
cnf.jkt, Glewlwyd's own records), the token at Glewlwyd's userinfo with `ctl proof` and its
refusals without a proof, with a replayed proof, a proof for another URL or another token; a
forced refresh with a proof; Glewlwyd's mandatory nonce (DPoP=auto); a refresh token issued
without DPoP, which Glewlwyd 2.7.5 refuses to refresh with a proof; and RFC 8707 resource
indicators with derived sessions by refresh (Derivation=refresh): the parent's device login asks
for its derived sessions' resources, a derived token's aud is its resource, the rotated refresh
token stays the parent's (Glewlwyd revokes a grant at any reuse), 8 processes -> one derivation,
invalid_target ends only that derived session, the parent's logout signs them out. Exit 0 when every check
passed, 1 when one failed, 0 with a SKIP line when Glewlwyd cannot be installed here. No token
is printed: tokens are named by a short fingerprint.
"""

import base64
import hashlib
import http.client
import json
import os
import queue
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "glewlwyd_fixture.py")
sys.path.insert(0, os.path.join(HERE, "..", "PyCommon"))
from checks import FAILURES, STEP_TIMEOUT, check, eventually, fingerprint, stop  # noqa: E402
from glewlwyd_fixture import RESOURCES  # noqa: E402


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
        return self.post_json(url, fields)[0]

    def post_json(self, url, fields, headers=None):
        """A form POST with the post client's credentials: (HTTP status, the JSON body or {})."""
        body = urllib.parse.urlencode(dict(fields, client_id="postclient", client_secret=self.secret("postclient"))).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers or {}), timeout=10) as response:
                status, text = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read()
        try:
            answer = json.loads(text)
        except ValueError:
            answer = {}
        return status, answer if isinstance(answer, dict) else {}

    def query(self, sql, *arguments):
        """Rows from Glewlwyd's own SQLite database, read-only (what the server recorded)."""
        con = sqlite3.connect(f"file:{self.info['database']}?mode=ro", uri=True, timeout=5)
        try:
            return con.execute(sql, arguments).fetchall()
        finally:
            con.close()

    def approve(self, code, plugin="oidc"):
        """Approves a device user code as the fixture user (at the given plugin instance)."""
        return code is not None and subprocess.run([sys.executable, FIXTURE, "approve-device", "--dir", self.directory,
                                                    "--user-code", code, "--plugin", plugin],
                                                   capture_output=True, timeout=60).returncode == 0

    def authorize(self, url):
        """Plays the browser for an authorization URL as the fixture user: (exit status, the
        Location it ended on (a secret: it carries the code) or "", its stderr's tail)."""
        out = subprocess.run([sys.executable, FIXTURE, "authorize", "--dir", self.directory, "--url", url],
                             capture_output=True, text=True, timeout=STEP_TIMEOUT)
        return out.returncode, out.stdout.strip(), out.stderr.strip()[:300]

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


def start_device_login(daemon, name):
    """`ctl login NAME` (device flow) running: (the process, the user code it printed or None)."""
    login = subprocess.Popen([os.path.join(daemon.bin_dir, "tokenbroker"), "ctl", "--socket", daemon.socket, "login", name],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + STEP_TIMEOUT
    while time.monotonic() < deadline:
        line = login.stdout.readline()
        if not line:
            break
        if "enter the code " in line:
            return login, line.rsplit("enter the code ", 1)[1].strip()
    return login, None


def finish_device_login(login):
    """Waits for a `ctl login` started by start_device_login: (exit status, its stderr)."""
    try:
        login.wait(timeout=STEP_TIMEOUT)
    except subprocess.TimeoutExpired:
        login.kill()
        login.wait()
    return login.returncode, login.stderr.read().strip()[:200]


class CodeLogin:
    """`ctl login NAME [flags]` for the authorization code flow, its stdin a pipe (a pasted
    redirect) and its stdout read by a thread, so every wait has a deadline."""

    def __init__(self, daemon, name, *flags):
        self.process = subprocess.Popen([os.path.join(daemon.bin_dir, "tokenbroker"), "ctl", "--socket", daemon.socket,
                                         "login", name, *flags],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        self.printed = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.url = self.waiting = None
        deadline = time.monotonic() + STEP_TIMEOUT
        while self.waiting is None:
            line = self._next(deadline)
            if line is None:
                break
            if line.strip().startswith("http") and "response_type=code" in line:
                self.url = line.strip()
            elif line.startswith("Waiting for the login"):
                self.waiting = line.strip()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _next(self, deadline):
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is not None:
            self.printed.append(line)
        return line

    def paste(self, text):
        try:
            self.process.stdin.write(text + "\n")
            self.process.stdin.flush()
        except OSError:
            pass

    def finish(self):
        """Waits for ctl: (exit status, its last stdout line, its stderr)."""
        try:
            self.process.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(timeout=STEP_TIMEOUT)
        while self._next(time.monotonic()) is not None:
            pass
        last = next((line.strip() for line in reversed(self.printed) if line.strip()), "")
        return self.process.returncode, last, self.process.stderr.read().strip()[:200]


def listener_get(location):
    """GET a redirect's path and query at the daemon's loopback listener, as the browser would
    (no redirects): (HTTP status, the page as text)."""
    target = urllib.parse.urlsplit(location)
    connection = http.client.HTTPConnection(target.hostname, target.port, timeout=10)
    try:
        connection.request("GET", target.path + ("?" + target.query if target.query else ""))
        response = connection.getresponse()
        return response.status, response.read(65536).decode(errors="replace")
    except OSError as error:
        return None, str(error)
    finally:
        connection.close()


def query_of(url):
    """A URL's query parameters, the first value of each."""
    return {key: values[0] for key, values in urllib.parse.parse_qs(urllib.parse.urlsplit(url or "").query).items()}


def b64url_json(part):
    try:
        return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except ValueError:
        return {}


def jwt_part(token, index):
    """A JWT's header (0) or payload (1), decoded without verifying anything; {} if not a JWT."""
    parts = (token or "").split(".")
    value = b64url_json(parts[index]) if len(parts) == 3 else {}
    return value if isinstance(value, dict) else {}


def jwk_thumbprint(jwk):
    """RFC 7638 (SHA-256) of an EC public key: its required members, lexicographic, compact."""
    if not isinstance(jwk, dict) or jwk.get("kty") != "EC" or not all(isinstance(jwk.get(k), str) for k in ("crv", "x", "y")):
        return None
    canonical = json.dumps({"crv": jwk["crv"], "kty": jwk["kty"], "x": jwk["x"], "y": jwk["y"]}, separators=(",", ":"))
    return base64.urlsafe_b64encode(hashlib.sha256(canonical.encode()).digest()).rstrip(b"=").decode()


def http_get(url, headers):
    """GET url: (HTTP status, response headers, the body's OAuth `error` or None). No body is kept."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            response.read()
            return response.status, response.headers, None
    except urllib.error.HTTPError as error:
        try:
            code = json.loads(error.read()).get("error")
        except (ValueError, AttributeError):
            code = None
        return error.code, error.headers, code


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
        config += session("glwd-code", clients["post"], "client_secret_post", Issuer=info["issuer"], Scope="openid api",
                          LoginRedirectPorts=info["code_redirect_port"], LoginFlow="code")
        # RFC 8707 (issue 35): derived sessions by refresh of a device-login parent. The parent's
        # login asks for both resources its derived sessions narrow to.
        config += session("glwd-rs", clients["post"], "client_secret_post", Scope="api",
                          DeviceAuthorizationEndpoint=info["device_authorization_endpoint"], **endpoints)
        for suffix, resource in (("a", RESOURCES[0]), ("b", RESOURCES[1])):
            config += f"[Session]\nName=glwd-rs-{suffix}\nDerivedFrom=glwd-rs\nDerivation=refresh\nResource={resource}\n\n"
        # DPoP sessions: the `oidc` plugin accepts DPoP; `oidcnonce` insists on its nonce.
        nonce_plugin = info["dpop_nonce_plugin"]
        config += session("glwd-dpop", clients["post"], "client_secret_post", Scope="api", DPoP="yes",
                          DeviceAuthorizationEndpoint=info["device_authorization_endpoint"], **endpoints)
        config += session("glwd-dpop-rt", clients["post"], "client_secret_post", DPoP="yes", **endpoints)
        config += session("glwd-dpop-nonce", clients["post"], "client_secret_post", Scope="api", DPoP="auto",
                          Issuer=nonce_plugin["issuer"])
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
        login, code = start_device_login(daemon, "glwd-device")
        check(server.approve(code), "glwd-device: ctl login prints a user code, approved at Glewlwyd")
        returncode, errors = finish_device_login(login)
        device_token = daemon.ctl("token", "glwd-device")
        secrets_seen.append(device_token.stdout.strip())
        check(returncode == 0 and device_token.returncode == 0 and device_token.stdout.strip(),
              "glwd-device: the device login completes and the session serves a token", errors)

        # -- RFC 8707 resource indicators, derived sessions by refresh (Derivation=refresh) -------
        # What Glewlwyd 2.7.5 does (read in its protocol_oidc.c, and seen here): a refresh may
        # name only a resource its grant was authorized for (gpor_resource), else invalid_target,
        # which spends nothing; the access token's aud is the resource; a rotating refresh
        # (refresh-token-one-use) with a resource narrows the rotated refresh token to it, so
        # after the first derivation the grant has that one resource: a second derived session
        # with another resource is refused, and the parent's own later tokens carry that aud.
        # It implements no RFC 8693 token exchange (a bare 400).
        def rs_grant_resources():
            rows = server.query("SELECT gpor_resource, gpor_enabled FROM gpo_refresh_token WHERE gpor_plugin_name='oidc' "
                                "AND gpor_client_id='postclient' AND gpor_resource IS NOT NULL ORDER BY gpor_id")
            return rows

        login, code = start_device_login(daemon, "glwd-rs")
        check(server.approve(code), "glwd-rs: the device login's code approved at Glewlwyd")
        returncode, errors = finish_device_login(login)
        check(returncode == 0, "glwd-rs: the device login completes", errors)
        granted = rs_grant_resources()
        check(bool(granted) and set(granted[0][0].split(",")) == set(RESOURCES),
              "glwd-rs: the login asked for the resources of its derived sessions (RFC 8707 §2.1: Glewlwyd's grant records both)",
              str([row[0] for row in granted]))
        parent = daemon.ctl("token", "glwd-rs").stdout.strip()
        derived = daemon.ctl("token", "glwd-rs-a")
        derived_token = derived.stdout.strip()
        secrets_seen += [parent, derived_token]
        check(derived.returncode == 0 and jwt_part(derived_token, 1).get("aud") == RESOURCES[0] and derived_token != parent,
              "glwd-rs-a: its token is the parent's refresh token redeemed with resource= (aud is the resource)",
              f"{derived.stderr.strip()[:120]} aud={jwt_part(derived_token, 1).get('aud')}")
        check(daemon.ctl("token", "glwd-rs").stdout.strip() == parent, "glwd-rs: the parent's own token is unchanged by the derivation")
        forced = daemon.ctl("refresh", "glwd-rs")
        check(forced.returncode == 0, "glwd-rs: the parent refreshes with the refresh token the derivation rotated "
              "(Glewlwyd revokes the whole grant at any reuse)", forced.stderr.strip())
        # Eight worker processes recover the same derived token at once: one derivation.
        workers = [subprocess.Popen([os.path.join(bin_dir, "tokenbroker"), "ctl", "--socket", daemon.socket, "recover", "glwd-rs-a"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for _ in range(8)]
        results = [worker.communicate(derived_token + "\n", timeout=STEP_TIMEOUT) for worker in workers]
        tokens = {out.strip() for out, _ in results}
        secrets_seen += list(tokens)
        check(all(w.returncode == 0 for w in workers) and len(tokens) == 1 and derived_token not in tokens
              and all(jwt_part(t, 1).get("aud") == RESOURCES[0] for t in tokens),
              "glwd-rs-a: 8 processes recovering the same derived token get one new one, narrowed", f"{len(tokens)} distinct")
        derivations = daemon.status("glwd-rs").get("derivations")
        check(derivations == 2, f"glwd-rs: two derivations in its lineage ({derivations})")
        after = daemon.ctl("refresh", "glwd-rs")
        check(after.returncode == 0 and daemon.status("glwd-rs").get("state") == "active",
              "glwd-rs: the parent refreshes again after the storm: no reuse", after.stderr.strip())
        print(f"  note: after a derivation, Glewlwyd's rotated grant has {rs_grant_resources()[-1][0]!r} alone; the parent's "
              f"token now has aud={jwt_part(daemon.ctl('token', 'glwd-rs').stdout.strip(), 1).get('aud')!r}")
        refused = daemon.ctl("token", "glwd-rs-b")
        status_b = daemon.status("glwd-rs-b")
        check(refused.returncode != 0 and status_b.get("state") == "ended" and "invalid_target" in (status_b.get("lastError") or ""),
              "glwd-rs-b: Glewlwyd refuses its resource (invalid_target, the grant was narrowed to the other): that derived session ends",
              f"{status_b.get('state')} {status_b.get('lastError')}")
        again = daemon.ctl("refresh", "glwd-rs")
        check(again.returncode == 0 and daemon.ctl("token", "glwd-rs-a").returncode == 0,
              "glwd-rs: the refusal spent nothing: the parent and its other derived session go on", again.stderr.strip())
        out = daemon.ctl("logout", "glwd-rs")
        signed_out = daemon.ctl("token", "glwd-rs-a")
        check(out.returncode == 0 and signed_out.returncode != 0 and daemon.status("glwd-rs-a").get("state") == "signedOut",
              "glwd-rs: the parent's logout signs its derived sessions out", signed_out.stderr.strip()[:120])
        check(eventually(lambda: not any(enabled for _, enabled in rs_grant_resources()), timeout=STEP_TIMEOUT),
              "glwd-rs: the logout revoked the grant at Glewlwyd (after it returned: revocation does not delay a logout)",
              str([enabled for _, enabled in rs_grant_resources()]))

        # -- Authorization code + PKCE: ctl prints the URL, the fixture plays the browser at Glewlwyd
        # (login, consent, g_continue), and the redirect comes back to the daemon: at its loopback
        # listener (a), or pasted into ctl (b). Glewlwyd requires PKCE (pkce-required) and matches
        # redirect URIs as exact strings, so LoginRedirectPorts= is the port the fixture registered
        # (another port: a bare 403, no redirect). Without g_continue its authorization endpoint
        # always sends the browser to login.html first, even with a session and a grant. Its ID
        # token (HS256 here) has iss (= Issuer=), aud (the client id, a string), azp, nonce, sub
        # (pairwise), auth_time, amr, at_hash, c_hash; a refresh answers no ID token.
        redirect_uri = f"http://127.0.0.1:{info['code_redirect_port']}/callback"

        def code_rows(challenge):
            """Glewlwyd's code records carrying this S256 challenge: [(redirect URI, nonce, enabled, id)]."""
            return server.query("SELECT gpoc_redirect_uri, gpoc_nonce, gpoc_enabled, gpoc_id FROM gpo_code "
                                "WHERE gpoc_plugin_name='oidc' AND gpoc_client_id='postclient' AND gpoc_code_challenge=?",
                                "{SHA256}" + (challenge or ""))

        def code_refresh_tokens():
            """Glewlwyd's refresh tokens of the code grant (authorization type 0) for postclient: (live, all)."""
            rows = server.query("SELECT gpor_enabled FROM gpo_refresh_token WHERE gpor_plugin_name='oidc' "
                                "AND gpor_client_id='postclient' AND gpor_authorization_type=0")
            return sum(1 for (enabled,) in rows if enabled), len(rows)

        login = CodeLogin(daemon, "glwd-code")          # LoginFlow=code chooses the flow
        asked = query_of(login.url)
        check(login.url is not None and login.url.split("?", 1)[0] == info["authorization_endpoint"] and login.waiting is not None,
              "glwd-code: ctl login prints a URL at Glewlwyd's authorization endpoint (discovered) and waits",
              "".join(login.printed)[-300:])
        check(asked.get("response_type") == "code" and asked.get("client_id") == "postclient"
              and asked.get("redirect_uri") == redirect_uri and asked.get("code_challenge_method") == "S256"
              and len(asked.get("code_challenge", "")) == 43 and asked.get("scope") == "openid api"
              and asked.get("state") and asked.get("nonce"),
              f"glwd-code: the URL asks for a code to {redirect_uri} (LoginRedirectPorts=), S256 PKCE, scope, state, nonce",
              str(sorted(asked)))
        status, location, errors = server.authorize(login.url) if login.url else (None, "", "no URL")
        answer = query_of(location)
        secrets_seen.append(answer.get("code", ""))
        check(status == 0 and location.startswith(redirect_uri + "?") and answer.get("code")
              and answer.get("state") == asked.get("state"),
              "glwd-code: Glewlwyd authorizes it (as alice) and redirects to the loopback URI with a code and the state", errors)
        check(answer.get("iss") == info["issuer"], "glwd-code: ... and iss= its issuer (RFC 9207, oauth-as-iss-id), which the daemon ignores")
        rows = code_rows(asked.get("code_challenge"))
        check(len(rows) == 1 and rows[0][:2] == (redirect_uri, asked.get("nonce")),
              "glwd-code: Glewlwyd's code record holds our S256 challenge, redirect URI and nonce", str(len(rows)))
        page_status, page = listener_get(location) if location else (None, "")
        check(page_status == 200 and "logged in" in page.lower(),
              f"glwd-code: the redirect at the daemon's listener: 200, a 'logged in' page ({page_status})", page[:120])
        returncode, said, errors = login.finish()
        check(returncode == 0 and said == "logged in glwd-code (generation 1)",
              "glwd-code: ctl login exits 0: logged in glwd-code (generation 1)", f"{said} {errors}")
        rows = code_rows(asked.get("code_challenge"))
        check(len(rows) == 1 and rows[0][2] == 0 and server.query("SELECT COUNT(*) FROM gpo_id_token WHERE gpoc_id=?", rows[0][3])[0][0] == 1,
              "glwd-code: the code was redeemed with its verifier (Glewlwyd spent it, and issued an ID token for it)")
        check(bool(daemon.lines("code login of session glwd-code done: generation 1")), "glwd-code: the journal logs the login")
        first = daemon.ctl("token", "glwd-code")
        secrets_seen.append(first.stdout.strip())
        check(first.returncode == 0 and first.stdout.strip(), "glwd-code: a token", first.stderr.strip())
        held_before = code_refresh_tokens()
        forced = daemon.ctl("refresh", "glwd-code")
        second = daemon.ctl("token", "glwd-code")
        secrets_seen.append(second.stdout.strip())
        check(forced.returncode == 0 and second.returncode == 0 and second.stdout.strip() not in ("", first.stdout.strip()),
              f"glwd-code: a forced refresh with the code's refresh token (token {fingerprint(first.stdout.strip())} -> "
              f"{fingerprint(second.stdout.strip())})", forced.stderr.strip())
        held_after = code_refresh_tokens()
        check(held_before == (1, 1) and held_after == (1, 2),
              f"glwd-code: the code's refresh token rotated at Glewlwyd (live, all: {held_before} -> {held_after})")

        # (b) The redirect pasted into ctl (a browser on another machine): the listener is never visited.
        login = CodeLogin(daemon, "glwd-code", "--flow=code")
        asked = query_of(login.url)
        status, location, errors = server.authorize(login.url) if login.url else (None, "", "no URL")
        secrets_seen.append(query_of(location).get("code", ""))
        check(status == 0 and location.startswith(redirect_uri + "?"), "glwd-code: a second login (--flow=code), authorized at Glewlwyd",
              errors)
        login.paste(location)
        returncode, said, errors = login.finish()
        check(returncode == 0 and said == "logged in glwd-code (generation 2)",
              "glwd-code: the redirect pasted into ctl's stdin: logged in glwd-code (generation 2)", f"{said} {errors}")
        check(bool(daemon.lines("the code login of session glwd-code was answered by a redirect pasted by")),
              "glwd-code: the journal says the redirect was pasted")
        rows = code_rows(asked.get("code_challenge"))
        check(len(rows) == 1 and rows[0][1] == asked.get("nonce") and rows[0][2] == 0,
              "glwd-code: Glewlwyd recorded this login's challenge and nonce, and the code is spent")
        third = daemon.ctl("token", "glwd-code")
        secrets_seen.append(third.stdout.strip())
        check(third.returncode == 0 and third.stdout.strip() not in ("", second.stdout.strip()),
              f"glwd-code: the new login's token is served ({fingerprint(third.stdout.strip())})", third.stderr.strip())
        # Glewlwyd enforces PKCE: the same request without the challenge is answered invalid_request.
        bare = login.url and info["authorization_endpoint"] + "?" + urllib.parse.urlencode(
            {k: v for k, v in asked.items() if k not in ("code_challenge", "code_challenge_method")})
        status, location, _ = server.authorize(bare) if bare else (None, "", "")
        refused = query_of(location)
        check(status == 0 and refused.get("error") == "invalid_request" and "code" not in refused,
              f"Glewlwyd (pkce-required): the request without code_challenge is redirected with error=invalid_request "
              f"({refused.get('error')})")

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

        # -- DPoP (RFC 9449) ----------------------------------------------------------------------
        # What Glewlwyd 2.7.5 (Debian 12) does, from its source (src/plugin/protocol_oidc.c at
        # v2.7.5) and checked below:
        # - It binds at the grant only. A token request with a valid proof binds the refresh token
        #   it issues (gpo_refresh_token.gpor_dpop_jkt) and the access token (cnf.jkt), answering
        #   token_type DPoP; a refresh then requires a proof from that same key and inherits the
        #   binding.
        # - A refresh token issued *without* DPoP cannot be refreshed *with* a proof: the proof is
        #   verified and its jti recorded, then the request is refused with 403 invalid_dpop_proof
        #   (its key is compared with the token's absent binding), where RFC 9449 §5 has the server
        #   bind the new access token. So a DPoP session logged in with the fixture's refresh token
        #   (the password grant, without a proof) can never refresh: it ends. The daemon's key never
        #   leaves it, so nothing outside the daemon can obtain a refresh token bound to it: the
        #   bound sessions here log in with the device flow, whose token request carries the proof.
        # - Its userinfo endpoint enforces DPoP-bound tokens: `Authorization: DPoP` plus a proof
        #   for GET and that URL whose `ath` is the token's hash; jti are recorded per client, so a
        #   replay is refused. Every refusal is a bare 401 (an invalid proof: body invalid_dpop_proof).
        # - oauth-dpop-allowed only decides discovery's dpop_signing_alg_values_supported (and the
        #   dpop_jkt parameter): proofs are verified and bound whatever it says.
        # - oauth-dpop-nonce-mandatory: one nonce per client id (not per plugin instance), at the
        #   token endpoint (400 use_dpop_nonce + DPoP-Nonce) and userinfo (401, WWW-Authenticate:
        #   DPoP error="use_dpop_nonce", DPoP-Nonce); each success counts oauth-dpop-nonce-counter
        #   down, and the one that finds 0 answers a new nonce in DPoP-Nonce. (The daemon keeps one
        #   nonce per origin for all its sessions: glwd-dpop's proofs to `oidc` carry `oidcnonce`'s
        #   nonce too, which `oidc` ignores.)
        userinfo = info["userinfo_endpoint"]
        token_endpoint = info["token_endpoint"]

        def proof(name, method, url, nonce=None):
            """`ctl proof`: (the headers it printed as a dict, its stderr); every value is a secret."""
            out = daemon.ctl("proof", name, method, url, *(["--nonce", nonce] if nonce else []))
            headers = {}
            for line in out.stdout.splitlines():
                key, _, value = line.partition(": ")
                if key in ("Authorization", "DPoP") and value:
                    headers[key] = value
                    secrets_seen.append(value.split(" ", 1)[-1])
            return (headers if out.returncode == 0 else {}), out.stderr.strip()[:200]

        def proof_json(name, method, url, nonce=None):
            """`ctl --json proof`: GetProof's answer ({} on failure)."""
            out = daemon.ctl("--json", "proof", name, method, url, *(["--nonce", nonce] if nonce else []))
            try:
                answer = json.loads(out.stdout) if out.returncode == 0 else {}
            except ValueError:
                answer = {}
            secrets_seen.extend(str(answer.get(k)) for k in ("token", "proof") if answer.get(k))
            return answer

        def bound_key(answer):
            """(the proof's jwk thumbprint, the access token's cnf.jkt) of a GetProof answer."""
            return (jwk_thumbprint(jwt_part(answer.get("proof"), 0).get("jwk")),
                    (jwt_part(answer.get("token"), 1).get("cnf") or {}).get("jkt"))

        def token_of(headers):
            return headers.get("Authorization", "").split(" ", 1)[-1]

        def recorded_proofs(plugin, htu, jkt):
            """How many proofs Glewlwyd verified and recorded (jti) for this URL and key."""
            return server.query("SELECT COUNT(*) FROM gpo_dpop WHERE gpod_plugin_name=? AND gpod_htu=? AND gpod_jkt=?",
                                plugin, htu, jkt)[0][0]

        def bound_refresh_tokens(plugin, jkt):
            """Glewlwyd's refresh tokens bound to this key: (live, all)."""
            rows = server.query("SELECT gpor_enabled FROM gpo_refresh_token WHERE gpor_plugin_name=? AND gpor_dpop_jkt=?",
                                plugin, jkt)
            return sum(1 for (enabled,) in rows if enabled), len(rows)

        check(info.get("dpop_signing_alg_values_supported") and "ES256" in info["dpop_signing_alg_values_supported"],
              "dpop: Glewlwyd's discovery lists ES256 in dpop_signing_alg_values_supported", str(info.get("dpop_signing_alg_values_supported")))

        # Device logins, both at once (Glewlwyd polls every 5 s): glwd-dpop (DPoP=yes, `oidc`) and
        # glwd-dpop-nonce (DPoP=auto from `oidcnonce`'s metadata; its nonce is mandatory, and the
        # device authorization answers none, so the first token request is refused with
        # use_dpop_nonce and the login completes only if the daemon retries with the nonce).
        logins = {name: start_device_login(daemon, name) for name in ("glwd-dpop", "glwd-dpop-nonce")}
        for name, plugin in (("glwd-dpop", "oidc"), ("glwd-dpop-nonce", nonce_plugin["name"])):
            check(server.approve(logins[name][1], plugin), f"{name}: ctl login prints a user code, approved at Glewlwyd ({plugin})")
        for name in logins:
            returncode, errors = finish_device_login(logins[name][0])
            check(returncode == 0, f"{name}: the device login completes (the device grant with a proof)", errors)

        # -- glwd-dpop: the token is bound to the daemon's key ----------------------------------
        answer = proof_json("glwd-dpop", "GET", userinfo)
        jkt, cnf = bound_key(answer)
        check(answer.get("tokenType") == "DPoP", "glwd-dpop: GetProof's tokenType is DPoP (Glewlwyd's token_type)", str(answer.get("tokenType")))
        check(jkt is not None and cnf == jkt,
              f"glwd-dpop: the access token's cnf.jkt is the RFC 7638 thumbprint of the proof's jwk ({fingerprint(jkt or '')})",
              f"cnf.jkt {fingerprint(cnf or '')}")
        check(jwt_part(answer.get("proof"), 0).get("alg") == "ES256" and jwt_part(answer.get("proof"), 1).get("htu") == userinfo,
              "glwd-dpop: the proof is ES256, for the userinfo URL")
        check(bound_refresh_tokens("oidc", jkt) == (1, 1), "glwd-dpop: Glewlwyd holds one refresh token, live and bound to the key",
              str(bound_refresh_tokens("oidc", jkt)))
        check(recorded_proofs("oidc", token_endpoint, jkt) == 1, "glwd-dpop: Glewlwyd recorded the device grant's proof")

        # The token at userinfo: with a fresh proof from `ctl proof`, and the refusals.
        headers, errors = proof("glwd-dpop", "GET", userinfo)
        token = token_of(headers)
        check(headers.get("Authorization", "").startswith("DPoP ") and headers.get("DPoP"),
              "glwd-dpop: ctl proof prints `Authorization: DPoP <token>` and `DPoP: <proof>`", errors)
        status, _, _ = http_get(userinfo, headers)
        check(status == 200, f"glwd-dpop: userinfo with the token and ctl proof's proof: 200 ({status})")
        status, _, _ = http_get(userinfo, headers)
        check(status == 401, f"glwd-dpop: the same proof again (a replay, its jti recorded): 401 ({status})")
        status, _, _ = http_get(userinfo, {"Authorization": "Bearer " + token})
        check(status == 401, f"glwd-dpop: the token as a Bearer token: 401 ({status})")
        status, _, _ = http_get(userinfo, {"Authorization": "DPoP " + token})
        check(status == 401, f"glwd-dpop: the token without a proof: 401 ({status})")
        fresh, _ = proof("glwd-dpop", "GET", userinfo)
        status, _, _ = http_get(userinfo, {"Authorization": "Bearer " + token, "DPoP": fresh.get("DPoP", "")})
        check(status == 401, f"glwd-dpop: a valid proof with the Bearer scheme: 401 ({status})")
        other, _ = proof("glwd-dpop", "GET", info["revocation_endpoint"])
        status, _, error = http_get(userinfo, other)
        check(status == 401 and error == "invalid_dpop_proof", f"glwd-dpop: a proof for another URL (htu): 401 {error} ({status})")

        # A forced refresh: with a proof, rotating, still bound; a proof made for the previous
        # token (its ath) is refused with the new one.
        stale, _ = proof("glwd-dpop", "GET", userinfo)
        forced = daemon.ctl("refresh", "glwd-dpop")
        headers, _ = proof("glwd-dpop", "GET", userinfo)
        new_token = token_of(headers)
        jkt_after = jwk_thumbprint(jwt_part(headers.get("DPoP"), 0).get("jwk"))
        check(forced.returncode == 0 and new_token and new_token != token,
              f"glwd-dpop: a forced refresh rotates (token {fingerprint(token)} -> {fingerprint(new_token)})", forced.stderr.strip())
        check(recorded_proofs("oidc", token_endpoint, jkt) == 2, "glwd-dpop: the refresh carried a proof Glewlwyd verified and recorded")
        check(jkt_after == jkt and (jwt_part(new_token, 1).get("cnf") or {}).get("jkt") == jkt,
              "glwd-dpop: the same key, and the new access token bound to it")
        check(bound_refresh_tokens("oidc", jkt) == (1, 2), "glwd-dpop: the refresh token rotated, the new one bound to the key",
              str(bound_refresh_tokens("oidc", jkt)))
        status, _, _ = http_get(userinfo, headers)
        check(status == 200, f"glwd-dpop: userinfo with the new token and a fresh proof: 200 ({status})")
        status, _, error = http_get(userinfo, {"Authorization": "DPoP " + new_token, "DPoP": stale.get("DPoP", "")})
        check(status == 401 and error == "invalid_dpop_proof",
              f"glwd-dpop: a proof made for the previous token (ath) with the new one: 401 {error} ({status})")

        # -- glwd-dpop-nonce: DPoP=auto, and Glewlwyd's mandatory nonce ------------------------
        nonce_userinfo = nonce_plugin["userinfo_endpoint"]
        answer = proof_json("glwd-dpop-nonce", "GET", nonce_userinfo)
        nonce_token = answer.get("token")
        njkt, ncnf = bound_key(answer)
        check(answer.get("tokenType") == "DPoP" and njkt is not None and ncnf == njkt and njkt != jkt,
              "glwd-dpop-nonce: DPoP=auto chose DPoP from the metadata: token_type DPoP, cnf.jkt its own key's thumbprint")
        check(recorded_proofs(nonce_plugin["name"], nonce_plugin["token_endpoint"], njkt) == 1,
              "glwd-dpop-nonce: the device grant's proof (with the nonce) was accepted and recorded")
        headers, _ = proof("glwd-dpop-nonce", "GET", nonce_userinfo)
        status, answered, _ = http_get(nonce_userinfo, headers)
        nonce = answered.get("DPoP-Nonce")
        secrets_seen.append(nonce or "")
        check(status == 401 and 'error="use_dpop_nonce"' in (answered.get("WWW-Authenticate") or "") and nonce,
              f"glwd-dpop-nonce: userinfo with a proof without a nonce: 401 use_dpop_nonce and a DPoP-Nonce ({status})")
        statuses, rotated = [], False
        for _ in range(3):        # oauth-dpop-nonce-counter=1: a new nonce within 2 successes
            headers, _ = proof("glwd-dpop-nonce", "GET", nonce_userinfo, nonce=nonce)
            status, answered, _ = http_get(nonce_userinfo, headers)
            statuses.append(status)
            if status == 200 and answered.get("DPoP-Nonce"):
                nonce, rotated = answered.get("DPoP-Nonce"), True
                secrets_seen.append(nonce)
                break
        check(statuses and all(s == 200 for s in statuses), f"glwd-dpop-nonce: with the nonce (ctl proof --nonce): 200 {statuses}")
        check(rotated, "glwd-dpop-nonce: Glewlwyd moved to a new nonce (DPoP-Nonce on a success)")
        # The daemon's last nonce is the one before: its refresh is refused with use_dpop_nonce
        # first, and succeeds only with the new nonce.
        forced = daemon.ctl("refresh", "glwd-dpop-nonce")
        check(forced.returncode == 0, "glwd-dpop-nonce: a forced refresh after the nonce changed succeeds (use_dpop_nonce answered)",
              forced.stderr.strip())
        check(recorded_proofs(nonce_plugin["name"], nonce_plugin["token_endpoint"], njkt) == 2,
              "glwd-dpop-nonce: the refresh's proof was accepted and recorded")
        headers, _ = proof("glwd-dpop-nonce", "GET", nonce_userinfo, nonce=nonce)
        status, _, _ = http_get(nonce_userinfo, headers)
        check(status == 200 and token_of(headers) != nonce_token,
              f"glwd-dpop-nonce: the refreshed token at userinfo with the nonce: 200 ({status})")

        # -- A refresh token issued without DPoP: Glewlwyd 2.7.5 refuses it with a proof ---------
        # Glewlwyd by itself first: the fixture's refresh token, a valid proof (the glwd-dpop key,
        # for POST and the token endpoint), then the same token without a proof.
        plain = server.refresh_token("postclient")
        secrets_seen.append(plain)
        probe, _ = proof("glwd-dpop", "POST", token_endpoint)
        status, answer = server.post_json(token_endpoint, {"grant_type": "refresh_token", "refresh_token": plain},
                                          {"DPoP": probe.get("DPoP", "")})
        secrets_seen.extend(str(answer.get(k)) for k in ("access_token", "refresh_token", "id_token") if answer.get(k))
        check(status == 403 and answer.get("error") == "invalid_dpop_proof",
              f"Glewlwyd 2.7.5: a refresh token issued without DPoP, refreshed with a valid proof: 403 invalid_dpop_proof "
              f"({status} {answer.get('error')})")
        check(recorded_proofs("oidc", token_endpoint, jkt) == 3, "Glewlwyd 2.7.5: ... though it verified that proof and recorded its jti")
        status, answer = server.post_json(token_endpoint, {"grant_type": "refresh_token", "refresh_token": plain})
        secrets_seen.extend(str(answer.get(k)) for k in ("access_token", "refresh_token", "id_token") if answer.get(k))
        check(status == 200 and str(answer.get("token_type")).lower() == "bearer",
              f"Glewlwyd 2.7.5: ... the same refresh token without a proof: 200, token_type {answer.get('token_type')} (not spent by the refusal)")

        # The daemon: glwd-dpop-rt (DPoP=yes) logged in with such a refresh token. Each refresh
        # carries a valid proof and is refused; the session ends like glwd-dead's, boundedly.
        held = server.refresh_token("postclient")
        secrets_seen.append(held)
        login = daemon.ctl("login", "glwd-dpop-rt", "--refresh-token-stdin", stdin=held + "\n")
        check(login.returncode == 0, "glwd-dpop-rt: login with a refresh token issued without DPoP", login.stderr.strip())
        before = server.query("SELECT COUNT(*) FROM gpo_dpop WHERE gpod_plugin_name='oidc' AND gpod_htu=?", token_endpoint)[0][0]
        headers, errors = proof("glwd-dpop-rt", "GET", userinfo)
        check(not headers and "invalid_dpop_proof" in errors, "glwd-dpop-rt: ctl proof fails: Glewlwyd answers invalid_dpop_proof", errors)
        ended = eventually(lambda: (daemon.ctl("token", "glwd-dpop-rt"), daemon.status("glwd-dpop-rt").get("state") == "ended")[1], timeout=30)
        status = daemon.status("glwd-dpop-rt")
        check(bool(ended) and "invalid_dpop_proof" in (status.get("lastError") or ""),
              "glwd-dpop-rt: the session ends, its reason naming invalid_dpop_proof",
              json.dumps({k: status.get(k) for k in ("state", "failures")}))
        refusals = daemon.lines("session glwd-dpop-rt: refresh failed (refused): invalid_dpop_proof")
        after = server.query("SELECT COUNT(*) FROM gpo_dpop WHERE gpod_plugin_name='oidc' AND gpod_htu=?", token_endpoint)[0][0]
        check(len(refusals) == 2 and len(daemon.lines("session glwd-dpop-rt: ended")) == 1 and after - before == 3,
              f"glwd-dpop-rt: 3 refreshes, each with a proof Glewlwyd verified and recorded ({after - before}), 2 refusals, then the end")
        check(server.refresh_works(held), "glwd-dpop-rt: the refresh token itself is fine: Glewlwyd refreshes it without a proof")

        # -- Logout of a DPoP session revokes its bound refresh token upstream ------------------
        logout = daemon.ctl("logout", "glwd-dpop")
        said = eventually(lambda: daemon.lines("session glwd-dpop: the refresh token retired by the logout is revoked upstream"), timeout=10)
        check(logout.returncode == 0 and bool(said), "glwd-dpop: logout, the revocation logged", logout.stderr.strip())
        check(bound_refresh_tokens("oidc", jkt) == (0, 2), "glwd-dpop: Glewlwyd holds no live refresh token bound to the key any more",
              str(bound_refresh_tokens("oidc", jkt)))
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
