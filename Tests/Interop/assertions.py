#!/usr/bin/env python3
"""tokenbroker's clients without a secret against two real servers nobody here wrote: Glewlwyd
2.7.5 (private_key_jwt, RFC 7523 §2.2) and an Authlib server (private_key_jwt, federated client
assertions and the JWT-bearer grant, RFC 7523 §2.1).

    assertions.py BIN_DIR

BIN_DIR holds `tokenbroker` and `tokenbroker-daemon`. The servers come from the fixtures beside
this file (glewlwyd_fixture.py, authlib_server.py: its venv is made on first use); each gets a
daemon of its own (own socket, state directory and configuration, run as the current user).

Glewlwyd (one daemon):
  gw-cc      Issuer=, ClientID=assertion-client, ClientAuthentication=private_key_jwt,
             ClientAssertionAudience=endpoint, Grant=client_credentials: the JWKS `ctl client-key`
             prints (kid = RFC 7638 thumbprint, no private member) registered at Glewlwyd; a token;
             TB_ASSERTION_REFRESHES (50) forced refreshes, all succeeding, each with a jti Glewlwyd
             never saw (it refuses any reused jti: its gpo_client_token_request records count
             them); the three-step rotation (--rotate, register the two keys; --promote; --retire,
             register the one) with refreshes between; the old key's JWKS alone registered -> a
             refresh fails (the new key signs), the new one registered again -> it succeeds.
  gw-rt      Grant=refresh_token with the daemon's key (client assertion-rt, whose JWKS also holds
             a key the fixture signs its password grant with): login by --refresh-token-stdin,
             refreshes rotating Glewlwyd's refresh token, logout revoking it upstream (the
             revocation carries an assertion whose aud is the revocation endpoint).
  gw-keyfile ClientKeyFile= (an RSA 2048 key made with openssl, mode 0600), ClientAssertionAlgorithm=
             PS256, the client pinned to PS256 at Glewlwyd: `ctl client-key` shows that key
             (role operator), login and refreshes.
Authlib (one daemon):
  al-jb      Grant=jwt-bearer, AssertionFile=, no ClientID: the first file from mint-platform-token,
             then a thread re-signing and swapping it (atomic rename) every 100 ms, as a trusted
             issuer of its own (trust-issuer) during the forced refreshes (TB_ASSERTION_REFRESHES,
             and on until 3 swaps were made) -> 0 failures, every
             grant Authlib saw one of the files written; an expired JWT in the file -> the refresh
             fails naming the file and "expired", the session does not end, a fresh file -> ok.
  al-pkj     private_key_jwt with the daemon's key, aud = the issuer (the default with Issuer=),
             client_credentials: forced refreshes, each assertion's jti new (Authlib's events).
  al-rsa     the same against an Authlib server whose metadata lists only RSA algorithms: the
             daemon makes an RSA key and signs RS256.
  al-fed     ClientAssertionFile= holding a federated platform token (register-client-keys
             --federated-subject) swapped every 100 ms during the forced refreshes -> 0 failures.
No secret anywhere: the state directory's files but state.key (state.db, -wal, -shm; running and
stopped), the daemons' logs, `ctl --json status`,
`ctl metrics` and `ctl client-key --json` hold no "PRIVATE KEY" marker, no line of the
ClientKeyFile's PEM body, no token or assertion; the client_keys rows are those of the sessions
whose key the daemon made, each sealed (tbenc1:), and the operator's key has none.

Exit 0 when every check passed, 1 when one failed, 0 with a SKIP line for a server that cannot be
installed here. No token, secret or key is printed: tokens are named by a short fingerprint.
"""

import base64
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "PyCommon"))
sys.path.insert(0, HERE)
from checks import FAILURES, STEP_TIMEOUT, check, eventually, fingerprint  # noqa: E402
import authlib_server  # noqa: E402  (its venv's place, write_atomically; no third-party import)
import glewlwyd_fixture  # noqa: E402  (openssl signing and JWKs, standard library only)
from glewlwyd import Daemon, Fixture, jwt_part  # noqa: E402

GLEWLWYD = os.path.join(HERE, "glewlwyd_fixture.py")
AUTHLIB = os.path.join(HERE, "authlib_server.py")
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
REFRESHES = int(os.environ.get("TB_ASSERTION_REFRESHES", "50"))
SWAP_INTERVAL = 0.1
PRIVATE_MEMBERS = ("d", "p", "q", "dp", "dq", "qi", "oth", "k")
# Many forced refreshes in a row: the guard's burst must not throttle them; a failure's backoff short.
TUNING = {"RefreshLimitBurst": "10000", "BackoffInitial": "100ms", "BackoffMax": "1s"}

SECRETS = []         # every token, refresh token and assertion seen: none may reach a log or reply


def run(script, *arguments, stdin=None):
    """A fixture command: its stdout (JSON or a credential). RuntimeError with its stderr's tail."""
    out = subprocess.run([sys.executable, script, *arguments], input=stdin, capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{os.path.basename(script)} {arguments[0]}: {out.stderr.strip()[-600:]}")
    return out.stdout.strip()


def session(name, **keys):
    return "[Session]\n" + f"Name={name}\n" + "".join(f"{k}={v}\n" for k, v in dict(keys, **TUNING).items()) + "\n"


def openssl_key(path, kind):
    """A private key made by the openssl CLI (EC P-256 or RSA 2048), mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    pkeyopt = "ec_paramgen_curve:P-256" if kind == "EC" else "rsa_keygen_bits:2048"
    subprocess.run(["openssl", "genpkey", "-algorithm", kind, "-pkeyopt", pkeyopt, "-out", path],
                   check=True, capture_output=True, timeout=STEP_TIMEOUT)
    os.chmod(path, 0o600)
    return path


def public_jwk(key_file, alg):
    jwk = glewlwyd_fixture.public_jwk(key_file)
    return dict(jwk, kid=glewlwyd_fixture.jwk_thumbprint(jwk), use="sig", alg=alg)


def thumbprint(jwk):
    """RFC 7638 of a public JWK (EC or RSA): its required members, lexicographic, compact."""
    required = {"EC": ("crv", "kty", "x", "y"), "RSA": ("e", "kty", "n")}.get(jwk.get("kty"))
    if not required or not all(isinstance(jwk.get(m), str) for m in required):
        return None
    canonical = json.dumps({m: jwk[m] for m in required}, separators=(",", ":"), sort_keys=True)
    return base64.urlsafe_b64encode(hashlib.sha256(canonical.encode()).digest()).rstrip(b"=").decode()


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f)
    return path


class Broker(Daemon):
    """glewlwyd.py's daemon, with what these checks ask of it."""

    def __init__(self, bin_dir, directory, config):
        super().__init__(bin_dir, directory, config)
        self.replies = []        # what ctl answered that must hold no key (status, metrics, client-key)
        self.key_sessions = set()  # the sessions whose key the daemon made and keeps (client_keys rows)

    def jwks(self, name, *flags):
        """`ctl client-key NAME [flags]`: (the JWKS printed or None, stderr)."""
        out = self.ctl("client-key", name, *flags)
        self.replies.append(out.stdout)
        try:
            value = json.loads(out.stdout) if out.returncode == 0 else None
        except ValueError:
            value = None
        return value, out.stderr.strip()[:200]

    def roles(self, name):
        """`ctl client-key NAME --json`: {kid: role}."""
        out = self.ctl("client-key", name, "--json")
        self.replies.append(out.stdout)
        try:
            return {k["kid"]: k["role"] for k in json.loads(out.stdout)["keys"]}
        except (ValueError, KeyError, TypeError):
            return {}

    def token(self, name):
        out = self.ctl("token", name)
        token = out.stdout.strip() if out.returncode == 0 else ""
        if token:
            SECRETS.append(token)
        return token, out.stderr.strip()[:200]

    def refresh(self, name):
        """`ctl --json refresh NAME`: (the new token's serial or None, stderr)."""
        out = self.ctl("--json", "refresh", name)
        try:
            serial = json.loads(out.stdout).get("tokenSerial") if out.returncode == 0 else None
        except ValueError:
            serial = None
        return serial, out.stderr.strip()[:300]

    def refreshes(self, name, count, until=None):
        """count forced refreshes in a row, and more while until() is false (for at most
        STEP_TIMEOUT): (failures [stderr], serials, seconds)."""
        failures, serials, started = [], [], time.monotonic()
        while len(failures) + len(serials) < count or (
                until is not None and not until() and time.monotonic() < started + STEP_TIMEOUT):
            serial, error = self.refresh(name)
            if serial is None:
                failures.append(error)
            else:
                serials.append(serial)
        return failures, serials, time.monotonic() - started

    def refresh_within(self, name, timeout=STEP_TIMEOUT):
        """Forced refreshes until one succeeds (a failure leaves a short backoff): (serial, attempts)."""
        attempts = []
        serial = eventually(lambda: (attempts.append(1), self.refresh(name)[0])[1], timeout=timeout, interval=0.1)
        return serial, len(attempts)

    def collect_replies(self):
        """`ctl --json status` and `ctl metrics`, kept for the secret scan."""
        answered = []
        for arguments in (("--json", "status"), ("metrics",)):
            out = self.ctl(*arguments)
            self.replies.append(out.stdout)
            answered.append(out.returncode == 0 and bool(out.stdout.strip()))
        check(all(answered), f"{os.path.basename(self.directory)}: ctl --json status and ctl metrics answer (kept for the scan)")

    def state_dir(self):
        return os.path.join(self.directory, "state")

    def state_files(self):
        """{name: bytes} of the state directory's files (state.db, -wal, -shm...) but state.key,
        the key that seals them."""
        files = {}
        for name in sorted(os.listdir(self.state_dir())):
            if name != "state.key" and os.path.isfile(os.path.join(self.state_dir(), name)):
                with open(os.path.join(self.state_dir(), name), "rb") as f:
                    files[name] = f.read()
        return files

    def client_keys(self):
        """The state DB's client_keys rows: [(session, kid, role, key)] (read-only)."""
        con = sqlite3.connect(f"file:{os.path.join(self.state_dir(), 'state.db')}?mode=ro", uri=True, timeout=5)
        try:
            return con.execute("SELECT session, kid, role, key FROM client_keys ORDER BY session, created").fetchall()
        finally:
            con.close()


class Swapper:
    """A platform renewing a JWT file: every 100 ms a new JWT (signed by the openssl CLI with the
    platform's key), written through a temporary file and a rename, as the fixtures and kubelet
    do. Keeps the fingerprints of all it wrote."""

    def __init__(self, path, key_file, kid, claims):
        self.path, self.key_file, self.kid, self.claims = path, key_file, kid, claims
        self.written, self.errors = [], []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def swap(self):
        now = int(time.time())
        jwt = glewlwyd_fixture.sign_jwt(self.key_file, "ES256", {"kid": self.kid},
                                        dict(self.claims, iat=now, exp=now + 300, jti=os.urandom(12).hex()))
        authlib_server.write_atomically(self.path, jwt)
        SECRETS.append(jwt)
        self.written.append(fingerprint(jwt))

    def _run(self):
        while not self.stopping.wait(SWAP_INTERVAL):
            try:
                self.swap()
            except Exception as error:          # noqa: BLE001 (reported by the check)
                self.errors.append(str(error)[:200])

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(timeout=STEP_TIMEOUT)


# ---------------------------------------------------------------- Glewlwyd
def glewlwyd(bin_dir, top, brokers, keys):
    try:
        server = Fixture(os.path.join(top, "glewlwyd"), 3600)
    except RuntimeError as error:
        if not shutil.which("glewlwyd"):
            print(f"SKIP glewlwyd cannot be installed here: {str(error)[-300:]}")
            return
        raise
    try:
        glewlwyd_checks(bin_dir, top, server, brokers, keys)
    finally:
        server.down()


def glewlwyd_checks(bin_dir, top, server, brokers, keys):
    info = server.info
    directory = server.directory

    def register(client, jwks, *extra):
        path = write_json(os.path.join(top, f"gw-{client}-{len(os.listdir(top))}.jwks"), jwks)
        try:
            return json.loads(run(GLEWLWYD, "register-client-keys", "--dir", directory, "--client", client,
                                  "--jwks", path, *extra))
        except RuntimeError as error:
            check(False, f"glewlwyd: register-client-keys {client}", str(error)[-300:])
            return {}

    def jti_count(client):
        """Glewlwyd's records of client assertions' jti for this client: (rows, distinct)."""
        return server.query("SELECT COUNT(*), COUNT(DISTINCT gpoctr_jti_hash) FROM gpo_client_token_request "
                            "WHERE gpoctr_plugin_name='oidc' AND gpoctr_cient_id=?", client)[0]

    def refresh_tokens(client):
        rows = server.query("SELECT gpor_enabled FROM gpo_refresh_token WHERE gpor_plugin_name='oidc' AND gpor_client_id=?",
                            client)
        return sum(1 for (enabled,) in rows if enabled), len(rows)

    rsa_key = openssl_key(os.path.join(top, "gw-operator-rsa.pem"), "RSA")     # ClientKeyFile=
    signer_key = openssl_key(os.path.join(top, "gw-fixture-ec.pem"), "EC")     # the fixture's password grant for assertion-rt
    keys.append(rsa_key)
    common = dict(Issuer=info["issuer"], ClientAuthentication="private_key_jwt", ClientAssertionAudience="endpoint")
    config = "[Broker]\nSocketMode=0600\n\n"
    config += session("gw-cc", ClientID="assertion-client", Grant="client_credentials", Scope="api", **common)
    config += session("gw-rt", ClientID="assertion-rt", **common)
    config += session("gw-keyfile", Issuer=info["issuer"], ClientID="assertion-rsa", ClientKeyFile=rsa_key,
                      ClientAssertionAlgorithm="PS256", ClientAssertionAudience="endpoint")
    daemon = Broker(bin_dir, os.path.join(top, "daemon-glewlwyd"), config)
    daemon.key_sessions = {"gw-cc", "gw-rt"}
    brokers.append(daemon)

    # -- gw-cc: the daemon's key ------------------------------------------------------------
    jwks1, errors = daemon.jwks("gw-cc")
    k1 = (jwks1 or {}).get("keys", [{}])[0] if jwks1 and len(jwks1.get("keys", [])) == 1 else {}
    check(bool(k1) and k1.get("kid") == thumbprint(k1) and k1.get("kty") == "EC" and k1.get("crv") == "P-256"
          and k1.get("alg") == "ES256" and k1.get("use") == "sig" and not any(m in k1 for m in PRIVATE_MEMBERS),
          f"gw-cc: ctl client-key prints a JWKS of one P-256 key, ES256, kid its RFC 7638 thumbprint "
          f"({fingerprint(k1.get('kid', ''))}), no private member", errors or json.dumps(jwks1)[:200])
    check(daemon.roles("gw-cc") == {k1.get("kid"): "signing"}, "gw-cc: --json: that key's role is signing")
    reg = register("assertion-client", jwks1 or {"keys": []})
    check(reg.get("kids") == [k1.get("kid")], "gw-cc: the JWKS registered at Glewlwyd for assertion-client (private_key_jwt only)")
    before = jti_count("assertion-client")
    token, errors = daemon.token("gw-cc")
    claims = jwt_part(token, 1)
    check(bool(token) and claims.get("client_id") == "assertion-client",
          f"gw-cc: ctl token: Glewlwyd's client_credentials token for the assertion ({fingerprint(token)})", errors)
    failures, serials, seconds = daemon.refreshes("gw-cc", REFRESHES)
    after = jti_count("assertion-client")
    check(not failures and len(serials) == REFRESHES and serials == sorted(set(serials)),
          f"gw-cc: {REFRESHES} forced refreshes: {len(serials)} ok, {len(failures)} failed, in {seconds:.1f} s",
          "; ".join(sorted(set(failures)))[:300])
    check(after[0] - before[0] == REFRESHES + 1 and after[0] == after[1],
          f"gw-cc: Glewlwyd recorded {after[0] - before[0]} assertions for them, every jti distinct "
          f"({after[1]} distinct of {after[0]}): a fresh jti per request")
    print(f"  figures: gw-cc {REFRESHES} refreshes in {seconds:.2f} s ({1000 * seconds / max(REFRESHES, 1):.0f} ms each)")

    # The rotation, in three steps, the JWKS registered at each.
    jwks2, errors = daemon.jwks("gw-cc", "--rotate")
    kids2 = [k.get("kid") for k in (jwks2 or {}).get("keys", [])]
    k2 = next((k for k in (jwks2 or {}).get("keys", []) if k.get("kid") != k1.get("kid")), {})
    check(len(kids2) == 2 and k1.get("kid") in kids2 and k2.get("kid") == thumbprint(k2),
          "gw-cc: --rotate prints the JWKS of two keys: the signing one and a next one", errors)
    check(daemon.roles("gw-cc") == {k1.get("kid"): "signing", k2.get("kid"): "next"}, "gw-cc: roles: signing, next")
    register("assertion-client", jwks2 or {"keys": []})
    serial, errors = daemon.refresh("gw-cc")
    check(serial is not None, "gw-cc: with both registered, a refresh (still the first key's)", errors)
    out = daemon.ctl("client-key", "gw-cc", "--promote")
    daemon.replies.append(out.stdout)
    check(out.returncode == 0 and daemon.roles("gw-cc") == {k1.get("kid"): "retiring", k2.get("kid"): "signing"},
          "gw-cc: --promote: the next key signs, the old one retires (still published)", out.stderr.strip()[:200])
    serial, errors = daemon.refresh("gw-cc")
    check(serial is not None, "gw-cc: a refresh after --promote", errors)
    jwks3, errors = daemon.jwks("gw-cc", "--retire")
    check([k.get("kid") for k in (jwks3 or {}).get("keys", [])] == [k2.get("kid")]
          and daemon.roles("gw-cc") == {k2.get("kid"): "signing"},
          "gw-cc: --retire: the JWKS holds the new key alone", errors)
    register("assertion-client", jwks3 or {"keys": []})
    serial, errors = daemon.refresh("gw-cc")
    check(serial is not None, "gw-cc: with the new key alone registered, a refresh", errors)
    register("assertion-client", {"keys": [k1]})
    serial, errors = daemon.refresh("gw-cc")
    check(serial is None and "403" in errors,
          f"gw-cc: with the OLD key alone registered, a refresh fails (the new key signs): {errors[:120]}")
    check(daemon.status("gw-cc").get("state") == "active", "gw-cc: ... a transient failure: the session is still active",
          str(daemon.status("gw-cc").get("state")))
    register("assertion-client", jwks3 or {"keys": []})
    serial, attempts = daemon.refresh_within("gw-cc")
    check(serial is not None, f"gw-cc: the new key registered again: a refresh succeeds (attempt {attempts}, after the backoff)")

    # -- gw-rt: a refresh-token session with the daemon's key ---------------------------------------
    jwks, errors = daemon.jwks("gw-rt")
    krt = (jwks or {}).get("keys", [{}])[0] if jwks else {}
    check(bool(krt) and krt.get("kid") not in (k1.get("kid"), k2.get("kid")),
          "gw-rt: a key of its own (not gw-cc's)", errors)
    # The fixture logs alice in (the password grant) as assertion-rt with a key of its own: the
    # client's JWKS holds both, the daemon's and the fixture's.
    reg = register("assertion-rt", {"keys": [krt, public_jwk(signer_key, "ES256")]}, "--key", signer_key)
    check(len(reg.get("kids", [])) == 2, "gw-rt: assertion-rt registered with the daemon's key and the fixture's")
    try:
        refresh_token = run(GLEWLWYD, "refresh-token", "--dir", directory, "--client", "assertion-rt")
    except RuntimeError as error:
        refresh_token = ""
        check(False, "gw-rt: a refresh token from Glewlwyd's password grant (the fixture's assertion)", str(error)[-300:])
    SECRETS.append(refresh_token)
    login = daemon.ctl("login", "gw-rt", "--refresh-token-stdin", stdin=refresh_token + "\n")
    check(login.returncode == 0, "gw-rt: login with --refresh-token-stdin", login.stderr.strip()[:200])
    first, errors = daemon.token("gw-rt")
    check(bool(first), f"gw-rt: ctl token: the refresh token redeemed with the daemon's assertion ({fingerprint(first)})", errors)
    count = max(5, REFRESHES // 5)
    failures, serials, seconds = daemon.refreshes("gw-rt", count)
    last, _ = daemon.token("gw-rt")
    held = refresh_tokens("assertion-rt")
    check(not failures and last not in ("", first),
          f"gw-rt: {count} forced refreshes: {len(serials)} ok, {len(failures)} failed ({fingerprint(first)} -> {fingerprint(last)})",
          "; ".join(sorted(set(failures)))[:300])
    check(held == (1, count + 2),
          f"gw-rt: Glewlwyd's refresh token rotated at each (live, all: {held}; {count + 2} expected)")
    out = daemon.ctl("logout", "gw-rt")
    said = eventually(lambda: daemon.lines("session gw-rt: the refresh token retired by the logout is revoked upstream"), timeout=10)
    check(out.returncode == 0 and bool(said), "gw-rt: logout, the revocation logged (its assertion's aud: the revocation endpoint)",
          out.stderr.strip()[:200])
    check(refresh_tokens("assertion-rt")[0] == 0, "gw-rt: Glewlwyd holds no live refresh token for assertion-rt any more",
          str(refresh_tokens("assertion-rt")))

    # -- gw-keyfile: the operator's RSA key, PS256 --------------------------------------------------
    reg = register("assertion-rsa", {"keys": [public_jwk(rsa_key, "PS256")]}, "--key", rsa_key, "--alg", "PS256")
    jwks, errors = daemon.jwks("gw-keyfile")
    kf = (jwks or {}).get("keys", [{}])[0] if jwks else {}
    check(bool(kf) and kf.get("kty") == "RSA" and kf.get("kid") == thumbprint(kf) and kf.get("kid") in reg.get("kids", [])
          and not any(m in kf for m in PRIVATE_MEMBERS),
          "gw-keyfile: ctl client-key shows ClientKeyFile='s public key (RSA, kid its thumbprint, the one Glewlwyd has)", errors)
    check(set(daemon.roles("gw-keyfile").values()) == {"operator"}, "gw-keyfile: --json: its role is operator",
          str(daemon.roles("gw-keyfile")))
    try:
        refresh_token = run(GLEWLWYD, "refresh-token", "--dir", directory, "--client", "assertion-rsa")
    except RuntimeError as error:
        refresh_token = ""
        check(False, "gw-keyfile: a refresh token for assertion-rsa", str(error)[-300:])
    SECRETS.append(refresh_token)
    login = daemon.ctl("login", "gw-keyfile", "--refresh-token-stdin", stdin=refresh_token + "\n")
    first, errors = daemon.token("gw-keyfile")
    check(login.returncode == 0 and bool(first),
          f"gw-keyfile: login, ctl token: PS256 assertions (the only alg Glewlwyd takes from this client) ({fingerprint(first)})",
          (login.stderr.strip() + " " + errors)[:300])
    failures, serials, _ = daemon.refreshes("gw-keyfile", 5)
    check(not failures and refresh_tokens("assertion-rsa") == (1, 7),
          f"gw-keyfile: 5 forced refreshes: {len(serials)} ok, Glewlwyd's refresh token rotated each time "
          f"{refresh_tokens('assertion-rsa')}", "; ".join(sorted(set(failures)))[:300])
    daemon.collect_replies()


# ---------------------------------------------------------------- Authlib
class Authlib:
    def __init__(self, directory, *flags):
        self.directory = directory
        self.info = json.loads(run(AUTHLIB, "up", "--dir", directory, *flags))

    def __call__(self, command, *arguments):
        return json.loads(run(AUTHLIB, command, "--dir", self.directory, *arguments))

    def events(self, **match):
        """Authlib's events.jsonl entries (one per token request) matching every key=value."""
        with open(self.info["events_file"]) as f:
            events = [json.loads(line) for line in f if line.strip()]
        return [e for e in events if all(e.get(k) == v for k, v in match.items())]

    def down(self):
        subprocess.run([sys.executable, AUTHLIB, "down", "--dir", self.directory], capture_output=True, timeout=60)


def authlib(bin_dir, top, brokers):
    servers = []
    try:
        try:
            servers.append(Authlib(os.path.join(top, "authlib")))
        except RuntimeError as error:
            marker = os.path.join(authlib_server.VENV, "fixture-pins.txt")
            if not os.path.exists(marker):
                print(f"SKIP authlib: its venv cannot be installed here: {str(error)[-300:]}")
                return
            raise
        servers.append(Authlib(os.path.join(top, "authlib-rsa"), "--algs", "RS256,PS256"))
        authlib_checks(bin_dir, top, servers[0], servers[1], brokers)
    finally:
        for server in servers:
            server.down()


def authlib_checks(bin_dir, top, server, rsa_server, brokers):
    info = server.info
    issuer = info["issuer"]
    platform = info["platform"]
    print(f"  authlib {info['versions']['authlib']} (joserfc {info['versions']['joserfc']}) at {issuer}")
    grant_file = os.path.join(top, "platform-grant.jwt")
    client_file = os.path.join(top, "platform-client.jwt")
    config = "[Broker]\nSocketMode=0600\n\n"
    config += session("al-jb", Issuer=issuer, Grant="jwt-bearer", AssertionFile=grant_file, Scope="api")
    config += session("al-pkj", Issuer=issuer, ClientID="pkj-client", ClientAuthentication="private_key_jwt",
                      Grant="client_credentials", Scope="api")
    config += session("al-rsa", Issuer=rsa_server.info["issuer"], ClientID="rsa-client", ClientAuthentication="private_key_jwt",
                      Grant="client_credentials", Scope="api")
    config += session("al-fed", Issuer=issuer, ClientID="fed-client", ClientAssertionFile=client_file,
                      Grant="client_credentials", Scope="api")

    def mint(path, sub, lifetime):
        minted = server("mint-platform-token", "--sub", sub, "--aud", issuer, "--lifetime", str(lifetime), "--out", path)
        with open(path) as f:
            SECRETS.append(f.read())
        return minted["sha256"]

    # The files exist before the daemon starts (a platform's would).
    first_grant = mint(grant_file, "workload-1", 300)
    first_client = mint(client_file, "workload-fed", 300)
    daemon = Broker(bin_dir, os.path.join(top, "daemon-authlib"), config)
    daemon.key_sessions = {"al-pkj", "al-rsa"}
    brokers.append(daemon)

    # -- al-jb: the JWT-bearer grant, no client ----------------------------------------------
    # A second platform issuer (a CI's), trusted with trust-issuer: the swapping thread signs as it.
    ci_key = openssl_key(os.path.join(top, "ci-issuer.pem"), "EC")
    ci_jwk = public_jwk(ci_key, "ES256")
    trusted = server("trust-issuer", "--issuer", "https://ci.test", "--jwks-json", json.dumps({"keys": [ci_jwk]}))
    check(trusted.get("kids") == [ci_jwk["kid"]], "authlib: trust-issuer https://ci.test (a key made with openssl)")
    check(daemon.status("al-jb").get("state") == "active", "al-jb: Grant=jwt-bearer: active without a login",
          str(daemon.status("al-jb")))
    token, errors = daemon.token("al-jb")
    issued = server.events(grant_type=JWT_BEARER, status=200)
    check(bool(token) and issued and issued[-1].get("access_token_sha256") == fingerprint(token)
          and issued[-1]["assertion"]["sha256"] == first_grant and issued[-1].get("client_id") is None
          and issued[-1].get("sub") == "workload-1" and not issued[-1].get("refresh_token"),
          f"al-jb: ctl token: Authlib's jwt-bearer grant of the file's JWT, no client authentication, no refresh token "
          f"({fingerprint(token)})", errors or json.dumps(issued[-1:])[:300])
    before = len(server.events(grant_type=JWT_BEARER))
    with Swapper(grant_file, ci_key, ci_jwk["kid"], {"iss": "https://ci.test", "sub": "workload-1", "aud": issuer}) as swapper:
        failures, serials, seconds = daemon.refreshes("al-jb", REFRESHES, until=lambda: len(swapper.written) >= 3)
    done = len(failures) + len(serials)
    grants = server.events(grant_type=JWT_BEARER)[before:]
    presented = {e["assertion"]["sha256"] for e in grants}
    check(not swapper.errors, f"al-jb: the file re-signed and swapped every 100 ms: {len(swapper.written)} swaps",
          "; ".join(swapper.errors[:3]))
    check(not failures and done >= REFRESHES,
          f"al-jb: {done} forced refreshes while it is swapped: {len(serials)} ok, {len(failures)} failed, in {seconds:.1f} s",
          "; ".join(sorted(set(failures)))[:300])
    check(len(grants) == done and all(e["status"] == 200 for e in grants)
          and presented <= set(swapper.written) | {first_grant} and len(presented) >= 2,
          f"al-jb: Authlib granted {sum(e['status'] == 200 for e in grants)} of {len(grants)}, each a JWT written to the file "
          f"({len(presented)} distinct, of {len(swapper.written)} written)")
    # An expired JWT in the file: a transient failure naming the file, never the session's end.
    mint(grant_file, "workload-1", -120)
    serial, errors = daemon.refresh("al-jb")
    check(serial is None and grant_file in errors and "expired" in errors.lower(),
          f"al-jb: an expired JWT in the file: ctl refresh fails naming the file and 'expired' ({errors[:160]})")
    status = daemon.status("al-jb")
    check(status.get("state") == "active", f"al-jb: ... the session is not ended (state {status.get('state')})")
    token_now, errors = daemon.token("al-jb")
    check(bool(token_now), f"al-jb: ... and still serves its current token ({fingerprint(token_now)})", errors)
    mint(grant_file, "workload-1", 300)
    serial, attempts = daemon.refresh_within("al-jb")
    check(serial is not None and daemon.status("al-jb").get("state") == "active",
          f"al-jb: a fresh JWT written: a refresh succeeds (attempt {attempts})")
    print(f"  figures: al-jb {done} refreshes in {seconds:.2f} s, {len(swapper.written)} swaps, "
          f"{len(presented)} distinct JWTs presented")

    # -- al-pkj: private_key_jwt, aud = issuer --------------------------------------------------
    jwks, errors = daemon.jwks("al-pkj")
    kp = (jwks or {}).get("keys", [{}])[0] if jwks else {}
    check(bool(kp) and kp.get("alg") == "ES256" and kp.get("kid") == thumbprint(kp),
          "al-pkj: ctl client-key: an ES256 key (Authlib lists ES256 first)", errors)
    reg = server("register-client-keys", "--client", "pkj-client", "--jwks-json", json.dumps(jwks or {"keys": []}),
                 "--grant", "client_credentials")
    check(reg.get("kids") == [kp.get("kid")], "al-pkj: its JWKS registered at Authlib (pkj-client, private_key_jwt)")
    token, errors = daemon.token("al-pkj")
    check(bool(token), f"al-pkj: ctl token ({fingerprint(token)})", errors)
    failures, serials, seconds = daemon.refreshes("al-pkj", REFRESHES)
    events = server.events(client_id="pkj-client")
    jtis = {e["client_assertion"]["jti_sha256"] for e in events}
    check(not failures and len(serials) == REFRESHES,
          f"al-pkj: {REFRESHES} forced refreshes: {len(serials)} ok, {len(failures)} failed, in {seconds:.1f} s",
          "; ".join(sorted(set(failures)))[:300])
    check(len(events) == REFRESHES + 1 and all(e["status"] == 200 and e["auth_method"] == "private_key_jwt" for e in events)
          and all(e["client_assertion"]["aud"] == issuer and e["client_assertion"]["iss"] == "pkj-client"
                  and e["client_assertion"]["sub"] == "pkj-client" for e in events),
          f"al-pkj: Authlib verified {len(events)} assertions (private_key_jwt), iss = sub = pkj-client, aud = the issuer")
    lifetimes = {e["client_assertion"]["exp"] - e["client_assertion"]["iat"] for e in events}
    check(len(jtis) == len(events) and lifetimes == {60},
          f"al-pkj: every jti distinct ({len(jtis)} of {len(events)}), exp = iat + 60 ({sorted(lifetimes)})")

    # -- al-rsa: a server that lists only RSA algorithms -------------------------------------
    jwks, errors = daemon.jwks("al-rsa")
    kr = (jwks or {}).get("keys", [{}])[0] if jwks else {}
    check(bool(kr) and kr.get("kty") == "RSA" and kr.get("alg") == "RS256" and kr.get("kid") == thumbprint(kr),
          f"al-rsa: metadata listing RS256, PS256 only: the daemon makes an RSA key, RS256 ({kr.get('kty')} {kr.get('alg')})", errors)
    rsa_server("register-client-keys", "--client", "rsa-client", "--jwks-json", json.dumps(jwks or {"keys": []}),
               "--grant", "client_credentials")
    token, errors = daemon.token("al-rsa")
    failures, serials, _ = daemon.refreshes("al-rsa", 5)
    events = rsa_server.events(client_id="rsa-client", status=200)
    check(bool(token) and not failures and len(events) == 6,
          f"al-rsa: ctl token and 5 forced refreshes: {len(events)} tokens issued", (errors + " " + "; ".join(failures))[:300])

    # -- al-fed: ClientAssertionFile= with a federated platform token ----------------------------
    reg = server("register-client-keys", "--client", "fed-client", "--federated-subject", "workload-fed",
                 "--grant", "client_credentials")
    check(reg.get("auth_methods") == ["federated_jwt"], "al-fed: fed-client bound to the platform's workload-fed (federated)")
    jwks, errors = daemon.jwks("al-fed")
    check(not (jwks or {}).get("keys"), "al-fed: ctl client-key: no key (ClientAssertionFile= holds none)",
          errors or json.dumps(jwks)[:120])
    token, errors = daemon.token("al-fed")
    first = server.events(client_id="fed-client", status=200)
    check(bool(token) and first and first[-1]["client_assertion"]["sha256"] == first_client
          and first[-1]["auth_method"] == "federated_jwt",
          f"al-fed: ctl token: the file's platform token as the client assertion ({fingerprint(token)})", errors)
    before = len(server.events())
    with Swapper(client_file, platform["key_file"], platform["kid"],
                 {"iss": platform["issuer"], "sub": "workload-fed", "aud": issuer}) as swapper:
        failures, serials, seconds = daemon.refreshes("al-fed", REFRESHES, until=lambda: len(swapper.written) >= 3)
    done = len(failures) + len(serials)
    window = server.events()[before:]
    events = [e for e in window if e.get("client_id") == "fed-client"]
    presented = {e["client_assertion"]["sha256"] for e in events}
    refused = [e for e in window if e["status"] != 200]
    check(not failures and done >= REFRESHES and not swapper.errors,
          f"al-fed: {done} forced refreshes while the file is swapped every 100 ms ({len(swapper.written)} swaps): "
          f"{len(serials)} ok, {len(failures)} failed, in {seconds:.1f} s",
          "; ".join(sorted(set(failures + swapper.errors)))[:300])
    check(len(events) == done and all(e["status"] == 200 and e["auth_method"] == "federated_jwt" for e in events)
          and presented <= set(swapper.written) | {first_client} and len(presented) >= 2
          and not refused,
          f"al-fed: Authlib took {len(events)} federated assertions, each a JWT written to the file ({len(presented)} distinct), "
          f"refused none")
    print(f"  figures: al-fed {done} refreshes in {seconds:.2f} s, {len(swapper.written)} swaps, "
          f"{len(presented)} distinct JWTs presented")
    daemon.collect_replies()


# ---------------------------------------------------------------- no secret anywhere
def no_secret(brokers, keys):
    bodies = []
    for path in keys:
        with open(path) as f:
            bodies += [line.strip() for line in f if line.strip() and not line.startswith("-----")]
    secrets = [s for s in SECRETS if s]
    for daemon in brokers:
        name = os.path.basename(daemon.directory)
        if not check(daemon.process.poll() is None, f"{name}: the daemon is still running after the runs",
                     daemon.journal()[-300:]):
            continue
        rows = daemon.client_keys()
        check({s for s, _, _, _ in rows} == daemon.key_sessions and all(key.startswith("tbenc1:") for _, _, _, key in rows),
              f"{name}: the state DB's client_keys rows ({', '.join(sorted(daemon.key_sessions))}: {len(rows)} row(s)) are sealed: "
              f"every key tbenc1:",
              str([(s, k[:8], r) for s, k, r, _ in rows]))
        check(not any(s == "gw-keyfile" for s, _, _, _ in rows), f"{name}: ClientKeyFile='s key is not copied into the state DB")
        running = daemon.state_files()
        daemon.stop()
        stopped = daemon.state_files()
        places = {f"{k} (running)": v for k, v in running.items()}
        places.update({f"{k} (stopped)": v for k, v in stopped.items()})
        places["daemon log"] = daemon.journal().encode()
        places["ctl replies"] = "\n".join(daemon.replies).encode()
        check(any("-wal" in k for k in places), f"{name}: scanned {', '.join(sorted(places))}")
        for place, data in sorted(places.items()):
            found = []
            if b"PRIVATE KEY" in data:
                found.append("a PEM PRIVATE KEY marker")
            lines = [line for line in bodies if line.encode() in data]
            if lines:
                found.append(f"{len(lines)} line(s) of a ClientKeyFile PEM")
            leaked = [fingerprint(s) for s in secrets if s.encode() in data]
            if leaked:
                found.append(f"tokens/assertions {','.join(sorted(set(leaked)))[:80]}")
            check(not found, f"{name}: no private key or token in {place}", "; ".join(found))


def main():
    bin_dir = os.path.abspath(sys.argv[1])
    for binary in ("tokenbroker", "tokenbroker-daemon"):
        if not os.access(os.path.join(bin_dir, binary), os.X_OK):
            print(f"FAIL {binary} is missing from {bin_dir}: build first")
            return 1
    top = tempfile.mkdtemp(prefix="tb-assertions-")
    os.chmod(top, 0o700)
    brokers, keys = [], []
    started = time.monotonic()
    timings = {}
    try:
        for name, part in (("glewlwyd", lambda: glewlwyd(bin_dir, top, brokers, keys)),
                           ("authlib", lambda: authlib(bin_dir, top, brokers))):
            t0 = time.monotonic()
            try:
                part()
            except Exception as error:           # noqa: BLE001 (a fixture that did not come up: one failure)
                check(False, f"{name}: {type(error).__name__}: {str(error)[-400:]}")
            timings[name] = time.monotonic() - t0
        no_secret(brokers, keys)
    finally:
        for daemon in brokers:
            if daemon.process.poll() is None:
                daemon.stop()
        subprocess.run(["rm", "-rf", top])
    print(f"assertions interop: {len(FAILURES)} failure(s), {time.monotonic() - started:.1f} s "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in timings.items())}), {REFRESHES} refreshes per storm")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
