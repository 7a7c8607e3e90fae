#!/usr/bin/env python3
"""A loopback OAuth 2.0 token endpoint built on Authlib (a third-party RFC 7523 implementation)
for the JWT interop tests: private_key_jwt client authentication and the JWT-bearer grant.

  up --dir DIR [--port P] [--access-token-lifetime S] [--leeway S] [--max-assertion-lifetime S]
     [--audience both|issuer|token-endpoint] [--platform-issuer URL] [--grant-replay accept|refuse]
     [--algs ES256,RS256,PS256]                       start in the background, print JSON
  register-client-keys --dir DIR --client ID (--jwks FILE | --jwks-json TEXT | --key PEM |
     --generate ES256|RS256|PS256) [--grant G ...] [--federated-subject SUB [--federated-issuer ISS]]
                                                      (re)register a private_key_jwt client
  trust-issuer --dir DIR --issuer ISS (--jwks FILE | --jwks-json TEXT) [--subject S ...]
                                                      trust another platform issuer's keys
  mint-platform-token --dir DIR --sub S --aud A --lifetime N --out FILE [--iss ISS] [--jti J |
     --no-jti] [--alg ES256]                          a JWT signed with the platform's key
  mint-assertion --dir DIR --client ID --out FILE [--aud A] [--lifetime N] [--jti J]
                                                      a private_key_jwt client assertion
  down --dir DIR                                      stop the server
  (serve --dir DIR: the server process itself, started by `up`.)

What verifies, and who wrote it:
  * Authlib's AuthorizationServer (framework-agnostic) on the standard library's http.server,
    127.0.0.1 only. POST /token; GET /.well-known/oauth-authorization-server (RFC 8414) and the
    same document at /.well-known/openid-configuration.
  * private_key_jwt: Authlib's JWTBearerClientAssertion (authlib.oauth2.rfc7523) under the method
    name private_key_jwt: iss and sub required and equal (the client id), aud required and one of
    the audiences (a string, or an array holding one), exp required and not past (leeway), nbf and
    iat, when present, not in the future (leeway), jti required and single-use (this fixture's
    in-memory cache: Authlib leaves its storage to the server), signature by a key of the client's
    registered JWKS (the header's kid picks it when there is one). This fixture adds: the
    algorithm allow-list (--algs; Authlib/joserfc alone allow only the "recommended" HS256, RS256
    and ES256) and exp at most --max-assertion-lifetime ahead.
  * federated client assertions (what a platform writes for ClientAssertionFile=; this fixture's
    code on joserfc, Authlib has none): client_assertion whose iss is a trusted platform issuer and
    (iss, sub) a client's --federated-subject binding; same checks, except jti is optional and may
    be replayed unless --grant-replay refuse.
  * the JWT-bearer grant (RFC 7523 §2.1): Authlib's JWTBearerGrant: iss must be a trusted issuer
    (the fixture's platform, or trust-issuer), signature by that issuer's JWKS, aud, exp, sub
    (required here), nbf/iat as above; no refresh token, ever. jti: optional, replay accepted
    unless --grant-replay refuse. Client authentication is optional (RFC 7523 §2.1): when the
    request carries any, it must succeed and the token is the client's; else it is the issuer's.
  * client_credentials: Authlib's ClientCredentialsGrant, the same client authentication methods.

Files under DIR: state.json (the configuration the server reloads when it changes), server.pid,
server.log, events.jsonl (one JSON object per token request: outcome, status, error, grant,
client, auth method, the assertion's iss/sub/aud/exp and its jti's and the issued token's SHA-256
fingerprints; never a token), platform-key.pem (mode 0600) and platform.jwks, client-ID.jwks and,
with --generate, client-ID-key.pem (0600).

Authlib, joserfc and cryptography come from PyPI at pinned versions, in a venv at
.build/tools/authlib (created on first use; AUTHLIB_FIXTURE_VENV overrides the path); every
command but `down` re-executes itself there. Tokens and keys are never printed: they are named by
the first 8 hex digits of their SHA-256.
"""
import argparse
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "PyCommon"))
from checks import fingerprint, process_argv, stop_pid  # noqa: E402
VENV = os.environ.get("AUTHLIB_FIXTURE_VENV") or os.path.join(ROOT, ".build", "tools", "authlib")
# Pinned: Authlib and all it pulls in (pip resolves nothing else).
PINS = ["authlib==1.9.10", "joserfc==1.8.0", "cryptography==51.0.1", "cffi==2.1.1", "pycparser==3.12"]
HOST = "127.0.0.1"
SCOPE = "api"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
CLIENT_ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
DEFAULT_ALGS = ["ES256", "RS256", "PS256"]
AUTH_METHODS = ["federated_jwt", "private_key_jwt", "client_secret_basic", "client_secret_post"]


class FixtureError(Exception):
    pass


# ---------------------------------------------------------------- helpers (no third-party code)
def write_private(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_atomically(path, text):
    """path (mode 0600) through a temporary file beside it and a rename: a reader sees the old
    content or the new, never a part."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write_private(tmp, text)
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class StateLock:
    """Serializes read-modify-write of DIR/state.json between commands."""

    def __init__(self, d):
        self.path = os.path.join(d, "state.lock")

    def __enter__(self):
        self.f = open(self.path, "a")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def load_state(d):
    try:
        with open(os.path.join(d, "state.json")) as f:
            return json.load(f)
    except OSError as e:
        raise FixtureError(f"no state in {d} (was `up` run?): {e}")


def save_state(d, s):
    write_atomically(os.path.join(d, "state.json"), json.dumps(s, indent=1))


def pid_alive(pid, d):
    """True if pid is this fixture's server for DIR d (and not a zombie)."""
    argv = process_argv(pid)
    return argv is not None and b"serve" in argv and os.path.abspath(d).encode() in argv \
        and any(a.endswith(b"authlib_server.py") for a in argv)


def free_port(port=0):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as e:
            raise FixtureError(f"port {port} on {HOST} is not free: {e}")
        return s.getsockname()[1]


# ---------------------------------------------------------------- the venv
def venv_python():
    return os.path.join(VENV, "bin", "python")


def in_venv():
    return os.path.realpath(sys.prefix) == os.path.realpath(VENV)


def ensure_venv():
    """Creates VENV with PINS when it is missing or holds other versions (idempotent, locked)."""
    marker = os.path.join(VENV, "fixture-pins.txt")
    want = "\n".join(PINS) + "\n"

    def ready():
        try:
            with open(marker) as f:
                return f.read() == want and os.access(venv_python(), os.X_OK)
        except OSError:
            return False

    if ready():
        return
    os.makedirs(os.path.dirname(VENV), exist_ok=True)
    with open(VENV + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready():
            return
        print(f"authlib_server: creating {VENV} with {' '.join(PINS)}", file=sys.stderr)
        if not os.access(venv_python(), os.X_OK):
            subprocess.run([sys.executable, "-m", "venv", VENV], check=True, stdout=sys.stderr)
        subprocess.run([venv_python(), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PINS],
                       check=True, stdout=sys.stderr)
        write_private(marker, want)


# ---------------------------------------------------------------- keys and JWTs (joserfc, in the venv)
def jose():
    from joserfc import jwk, jwt  # noqa: F401
    return jwk, jwt


def import_private_key(path):
    jwk, _ = jose()
    with open(path, "rb") as f:
        pem = f.read()
    for cls in (jwk.ECKey, jwk.RSAKey, jwk.OKPKey):
        try:
            return cls.import_key(pem)
        except Exception:
            continue
    raise FixtureError(f"{path}: not a PEM private key joserfc can read")


def public_jwk(key, alg=None):
    d = key.as_dict(private=False)
    d.update(kid=key.thumbprint(), use="sig")
    if alg:
        d["alg"] = alg
    return d


def default_alg(key):
    return {"EC": "ES256", "RSA": "RS256", "OKP": "EdDSA"}[key.key_type]


def generate_key(alg, path):
    jwk, _ = jose()
    key = jwk.ECKey.generate_key("P-256") if alg == "ES256" else jwk.RSAKey.generate_key(2048)
    write_private(path, key.as_pem(private=True).decode())
    return key


def sign_jwt(key, alg, claims, kid=None):
    _, jwt = jose()
    header = {"alg": alg, "typ": "JWT", "kid": kid or key.thumbprint()}
    return jwt.encode(header, claims, key, algorithms=[alg])


def read_jwks_arg(a):
    if a.jwks:
        with open(a.jwks) as f:
            doc = json.load(f)
    else:
        doc = json.loads(a.jwks_json)
    keys = doc["keys"] if isinstance(doc, dict) and "keys" in doc else [doc]
    for k in keys:
        if not isinstance(k, dict) or not k.get("kty"):
            raise FixtureError("not a JWKS: a key without kty")
        if any(m in k for m in ("d", "p", "q", "dp", "dq", "qi", "k")):
            raise FixtureError("the JWKS holds private key material: register public keys only")
    jwk, _ = jose()
    jwk.KeySet.import_key_set({"keys": keys})      # refuses what joserfc cannot use
    return {"keys": keys}


# ---------------------------------------------------------------- the server (Authlib)
def serve(d):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading
    import urllib.parse

    from authlib.oauth2 import rfc6749
    from authlib.oauth2.rfc6749 import (AuthorizationServer, ClientMixin, InvalidClientError,
                                        InvalidGrantError, OAuth2Request)
    from authlib.oauth2.rfc6749.grants import ClientCredentialsGrant
    from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload
    from authlib.oauth2.rfc6750 import BearerTokenGenerator
    from authlib.oauth2.rfc7523 import JWTBearerClientAssertion, JWTBearerGrant
    from joserfc import jwt
    from joserfc.errors import JoseError
    from joserfc.jwk import KeySet

    lock = threading.RLock()          # one token request at a time: replay checks are atomic
    cache = {"mtime": None, "state": None}
    seen_client_jti = {}              # (client id, jti) -> exp: private_key_jwt replay
    seen_platform_jti = {}            # (iss, jti) -> exp: grant/federated replay (--grant-replay refuse)

    def state():
        st = os.stat(os.path.join(d, "state.json")).st_mtime_ns
        if st != cache["mtime"]:
            cache["state"], cache["mtime"] = load_state(d), st
        return cache["state"]

    def audiences():
        s = state()
        return {"both": [s["issuer"], s["token_endpoint"]], "issuer": [s["issuer"]],
                "token-endpoint": [s["token_endpoint"]]}[s["audience"]]

    def remember(table, key, exp):
        now = time.time()
        for k in [k for k, e in table.items() if e < now - 600]:
            del table[k]
        if key in table:
            return False
        table[key] = exp
        return True

    def check_lifetime(claims, error):
        s = state()
        if isinstance(claims.get("exp"), (int, float)) and claims["exp"] - time.time() > s["max_assertion_lifetime"] + s["leeway"]:
            raise error(description=f"exp is more than {s['max_assertion_lifetime']} s ahead")

    class Client(ClientMixin):
        def __init__(self, client_id, record):
            self.client_id, self.record = client_id, record

        def get_client_id(self):
            return self.client_id

        def get_default_redirect_uri(self):
            return None

        def get_allowed_scope(self, scope):
            allowed = set(self.record.get("scope", [SCOPE]))
            if not scope:
                return " ".join(sorted(allowed))
            return " ".join(s for s in scope.split() if s in allowed)

        def check_redirect_uri(self, redirect_uri):
            return False

        def check_client_secret(self, client_secret):
            secret = self.record.get("secret")
            return bool(secret) and secrets.compare_digest(secret, client_secret)

        def check_endpoint_auth_method(self, method, endpoint):
            return method in self.record.get("auth_methods", [])

        def check_response_type(self, response_type):
            return False

        def check_grant_type(self, grant_type):
            return grant_type in self.record.get("grant_types", [])

        def keys(self):
            return KeySet.import_key_set(self.record["jwks"])

    def query_client(client_id):
        if not isinstance(client_id, str):
            return None
        rec = state()["clients"].get(client_id)
        return Client(client_id, rec) if rec else None

    def issuer_keys(iss):
        rec = state()["issuers"].get(iss)
        return KeySet.import_key_set(rec["jwks"]) if rec else None

    class PrivateKeyJWT(JWTBearerClientAssertion):
        """Authlib's RFC 7523 §2.2 verifier, as token_endpoint_auth_method private_key_jwt."""
        CLIENT_AUTH_METHOD = "private_key_jwt"

        def get_audiences(self):
            return audiences()

        def resolve_client_public_key(self, client):
            return client.keys()

        def validate_jti(self, claims, jti):
            return remember(seen_client_jti, (claims["sub"], jti), claims.get("exp", 0))

        def process_assertion_claims(self, assertion, resolve_key):
            # Authlib's, with an algorithm allow-list (joserfc's default takes only HS256/RS256/ES256).
            try:
                token = jwt.decode(assertion, resolve_key, algorithms=state()["algs"])
            except JoseError as e:
                raise InvalidClientError(description=e.description) from e
            except ValueError as e:
                raise InvalidClientError(description="Invalid JWT assertion") from e
            check_lifetime(token.claims, InvalidClientError)
            self.verify_claims(token.claims)
            return token.claims

    def federated_jwt(query_client_, request):
        """A platform-issued client_assertion (iss: a trusted issuer, (iss, sub) bound to a
        client). None when the assertion is not one (private_key_jwt may take it then)."""
        form = request.form
        assertion = form.get("client_assertion")
        if form.get("client_assertion_type") != CLIENT_ASSERTION_TYPE or not assertion:
            return None
        try:
            _, claims = PrivateKeyJWT().extract_assertion(assertion)
        except InvalidClientError:
            return None
        iss, sub = claims.get("iss"), claims.get("sub")
        if not isinstance(iss, str) or iss not in state()["issuers"] or iss == sub:
            return None
        bound = [cid for cid, rec in state()["clients"].items()
                 if {"issuer": iss, "subject": sub} in rec.get("federated", [])]
        if form.get("client_id"):
            bound = [cid for cid in bound if cid == form.get("client_id")]
        if len(bound) != 1:
            raise InvalidClientError(description="No client is bound to this issuer and subject")
        try:
            token = jwt.decode(assertion, issuer_keys(iss), algorithms=state()["algs"])
        except JoseError as e:
            raise InvalidClientError(description=e.description) from e
        check_lifetime(token.claims, InvalidClientError)
        registry = jwt.JWTClaimsRegistry(leeway=state()["leeway"], iss={"essential": True},
                                         sub={"essential": True}, exp={"essential": True},
                                         aud={"essential": True, "values": audiences()})
        try:
            registry.validate(token.claims)
        except JoseError as e:
            raise InvalidClientError(description=e.description) from e
        if state()["grant_replay"] == "refuse":
            if "jti" not in token.claims:
                raise InvalidClientError(description="Missing JWT ID.")
            if not remember(seen_platform_jti, (iss, token.claims["jti"]), token.claims["exp"]):
                raise InvalidClientError(description="JWT ID is used before.")
        return query_client(bound[0])

    class PlatformIssuer(ClientMixin):
        """The 'client' Authlib's JWTBearerGrant resolves an assertion's iss to: a trusted issuer."""

        def __init__(self, iss, record):
            self.iss, self.record = iss, record

        def get_client_id(self):
            return None

        def get_allowed_scope(self, scope):
            return " ".join(s for s in (scope or SCOPE).split() if s == SCOPE)

        def check_grant_type(self, grant_type):
            return grant_type == JWT_BEARER

    class ClientCredentials(ClientCredentialsGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = AUTH_METHODS

    class JWTBearer(JWTBearerGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = AUTH_METHODS
        CLAIMS_OPTIONS = {"iss": {"essential": True}, "sub": {"essential": True},
                          "aud": {"essential": True}, "exp": {"essential": True}}

        @property
        def LEEWAY(self):
            return state()["leeway"]

        def get_audiences(self):
            return audiences()

        def resolve_issuer_client(self, issuer):
            rec = state()["issuers"].get(issuer)
            return PlatformIssuer(issuer, rec) if rec else None

        def resolve_client_public_key(self, client):
            return issuer_keys(client.iss)

        def process_assertion_claims(self, assertion):
            # Authlib's, with an algorithm allow-list.
            _, claims = self.extract_assertion(assertion)
            if not isinstance(claims.get("iss"), str):
                raise InvalidGrantError(description="Missing or invalid claim: 'iss'")
            client = self.resolve_issuer_client(claims["iss"])
            if not client:
                raise InvalidGrantError(description="The issuer is not trusted by this server.")
            try:
                token = jwt.decode(assertion, self.resolve_client_public_key(client), algorithms=state()["algs"])
            except JoseError as e:
                raise InvalidGrantError(description=e.description) from e
            except ValueError as e:
                raise InvalidGrantError(description="Invalid JWT assertion") from e
            check_lifetime(token.claims, InvalidGrantError)
            self.verify_claims(token.claims)
            if state()["grant_replay"] == "refuse":
                if "jti" not in token.claims:
                    raise InvalidGrantError(description="Missing JWT ID.")
                if not remember(seen_platform_jti, (claims["iss"], token.claims["jti"]), token.claims["exp"]):
                    raise InvalidGrantError(description="JWT ID is used before.")
            return token.claims

        def authenticate_user(self, subject):
            return {"sub": subject}

        def has_granted_permission(self, client, user):
            # client: the PlatformIssuer of the assertion's iss (trust-issuer --subject limits it)
            subjects = client.record.get("subjects")
            return subjects is None or user["sub"] in subjects

        def validate_token_request(self):
            form = self.request.form
            client = None
            if (self.request.headers.get("Authorization") or form.get("client_secret")
                    or form.get("client_assertion")):
                client = self.authenticate_token_endpoint_client()
            super().validate_token_request()
            if client is not None:
                if not client.check_grant_type(self.GRANT_TYPE):
                    raise rfc6749.UnauthorizedClientError(
                        f"The client is not authorized to use 'grant_type={self.GRANT_TYPE}'")
                self.request.client = client
                self.validate_requested_scope()

    class Request(OAuth2Request):
        def __init__(self, method, uri, headers, form):
            super().__init__(method, uri, headers=headers)
            self._form = form
            self.payload = BasicOAuth2Payload(form)

        @property
        def args(self):
            return {}

        @property
        def form(self):
            return self._form

    class Server(AuthorizationServer):
        def query_client(self, client_id):
            return query_client(client_id)

        def save_token(self, token, request):
            request.issued = token

        def create_oauth2_request(self, request):
            return request

        def create_json_request(self, request):
            raise NotImplementedError()

        def handle_response(self, status, body, headers):
            return status, body, headers

        def send_signal(self, name, *args, **kwargs):
            pass

    server = Server(scopes_supported=[SCOPE])
    server.register_client_auth_method("private_key_jwt", PrivateKeyJWT())
    server.register_client_auth_method("federated_jwt", federated_jwt)
    server.register_grant(ClientCredentials)
    server.register_grant(JWTBearer)
    server.register_token_generator("default", BearerTokenGenerator(
        access_token_generator=lambda **kw: secrets.token_urlsafe(32),
        expires_generator=lambda client, grant_type: state()["access_token_lifetime"]))

    def unverified_claims(jwt_text):
        try:
            import base64
            part = jwt_text.split(".")[1]
            claims = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
            return claims if isinstance(claims, dict) else {}
        except Exception:
            return {}

    def record(event):
        with open(os.path.join(d, "events.jsonl"), "a") as f:
            f.write(json.dumps(event) + "\n")

    def metadata():
        s = state()
        doc = {"issuer": s["issuer"], "token_endpoint": s["token_endpoint"],
               "token_endpoint_auth_methods_supported": ["private_key_jwt", "client_secret_basic", "client_secret_post"],
               "token_endpoint_auth_signing_alg_values_supported": s["algs"],
               "grant_types_supported": ["client_credentials", JWT_BEARER],
               "scopes_supported": [SCOPE], "response_types_supported": []}
        return doc

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            sys.stderr.write("%s %s\n" % (time.strftime("%H:%M:%S"), fmt % args))

        def send_json(self, status, body, headers=()):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            for k, v in headers:
                if k.lower() not in ("content-type", "content-length", "cache-control"):
                    self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            with lock:
                if path in ("/.well-known/oauth-authorization-server", "/.well-known/openid-configuration"):
                    return self.send_json(200, metadata())
            self.send_json(404, {"error": "not_found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode("utf-8", "replace")
            if self.path.split("?", 1)[0] != "/token":
                return self.send_json(404, {"error": "not_found"})
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if ctype != "application/x-www-form-urlencoded":
                return self.send_json(400, {"error": "invalid_request", "error_description": "form body expected"})
            pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True)
            form = {}
            for k, v in pairs:
                if k in form:      # RFC 6749 §3.2: parameters MUST NOT be repeated
                    return self.send_json(400, {"error": "invalid_request", "error_description": f"repeated parameter {k}"})
                form[k] = v
            headers = {k: v for k, v in self.headers.items()}
            with lock:
                s = state()
                request = Request("POST", s["token_endpoint"], headers, form)
                status, body, hdrs = server.create_token_response(request)
                body = body if isinstance(body, dict) else {}
                event = {"time": round(time.time(), 3), "status": status,
                         "outcome": "issued" if status == 200 else "refused",
                         "grant_type": form.get("grant_type"), "error": body.get("error"),
                         "error_description": body.get("error_description"),
                         "client_id": request.client.get_client_id() if request.client is not None else None,
                         "auth_method": request.auth_method, "form_client_id": form.get("client_id"),
                         "scope": body.get("scope")}
                for name in ("assertion", "client_assertion"):
                    if form.get(name):
                        c = unverified_claims(form[name])
                        event[name] = {"sha256": fingerprint(form[name]), "iss": c.get("iss"), "sub": c.get("sub"),
                                       "aud": c.get("aud"), "exp": c.get("exp"), "iat": c.get("iat"),
                                       "jti_sha256": fingerprint(str(c["jti"])) if "jti" in c else None}
                if status == 200:
                    event["access_token_sha256"] = fingerprint(body["access_token"])
                    event["expires_in"] = body.get("expires_in")
                    event["refresh_token"] = "refresh_token" in body
                    if request.user:
                        event["sub"] = request.user.get("sub")
                record(event)
            self.send_json(status, body, hdrs)

    httpd = ThreadingHTTPServer((HOST, state()["port"]), Handler)
    httpd.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown).start())
    print(f"serving {state()['issuer']}", file=sys.stderr, flush=True)
    httpd.serve_forever()


# ---------------------------------------------------------------- commands
def cmd_up(a):
    t0 = time.monotonic()
    d = os.path.abspath(a.dir)
    os.makedirs(d, exist_ok=True)
    pidfile = os.path.join(d, "server.pid")
    if os.path.exists(pidfile):
        with open(pidfile) as f:
            if pid_alive(int(f.read().strip() or 0), d):
                raise FixtureError(f"a server from {d} is already running; run `down` first")
    port = free_port(a.port)
    base = f"http://{HOST}:{port}"
    algs = [x for x in a.algs.split(",") if x]
    platform_key_file = os.path.join(d, "platform-key.pem")
    key = generate_key("ES256", platform_key_file)
    platform_jwks = {"keys": [public_jwk(key, "ES256")]}
    platform_jwks_file = os.path.join(d, "platform.jwks")
    write_private(platform_jwks_file, json.dumps(platform_jwks))
    s = {"port": port, "base_url": base, "issuer": base, "token_endpoint": base + "/token",
         "metadata_url": base + "/.well-known/oauth-authorization-server",
         "access_token_lifetime": a.access_token_lifetime, "leeway": a.leeway,
         "max_assertion_lifetime": a.max_assertion_lifetime, "audience": a.audience,
         "grant_replay": a.grant_replay, "algs": algs,
         "platform": {"issuer": a.platform_issuer, "key_file": platform_key_file, "jwks_file": platform_jwks_file,
                      "kid": platform_jwks["keys"][0]["kid"], "alg": "ES256"},
         "issuers": {a.platform_issuer: {"jwks": platform_jwks, "subjects": None}},
         "clients": {}}
    with StateLock(d):
        save_state(d, s)
    with open(os.path.join(d, "events.jsonl"), "w"):
        pass
    log = open(os.path.join(d, "server.log"), "ab")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", "--dir", d],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=d)
    with open(pidfile, "w") as f:
        f.write(f"{proc.pid}\n")
    a.started = True
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise FixtureError(f"the server exited with {proc.returncode} during startup")
        try:
            with urllib.request.urlopen(s["metadata_url"], timeout=1) as r:
                if r.status == 200 and json.load(r).get("issuer") == base:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise FixtureError("the server did not answer within 20 s")
        time.sleep(0.05)
    import authlib, joserfc, cryptography
    out = {k: s[k] for k in ("base_url", "issuer", "token_endpoint", "metadata_url", "port",
                             "access_token_lifetime", "leeway", "max_assertion_lifetime",
                             "audience", "grant_replay", "algs", "platform")}
    out.update(pid=proc.pid, state_file=os.path.join(d, "state.json"),
               events_file=os.path.join(d, "events.jsonl"), log_file=os.path.join(d, "server.log"),
               audiences=[base, base + "/token"] if a.audience == "both" else
               [base] if a.audience == "issuer" else [base + "/token"],
               versions={"authlib": authlib.__version__, "joserfc": joserfc.__version__,
                         "cryptography": cryptography.__version__, "python": sys.version.split()[0]},
               venv=VENV, up_seconds=round(time.monotonic() - t0, 3))
    print(json.dumps(out))


def cmd_register_client_keys(a):
    d = os.path.abspath(a.dir)
    key_file, alg = None, a.alg
    if a.generate:
        key_file = os.path.join(d, f"client-{a.client}-key.pem")
        key = generate_key(a.generate, key_file)
        alg = a.generate
        jwks = {"keys": [public_jwk(key, alg)]}
    elif a.key:
        key_file = os.path.abspath(a.key)
        key = import_private_key(key_file)
        alg = alg or default_alg(key)
        jwks = {"keys": [public_jwk(key, alg)]}
    elif a.jwks or a.jwks_json:
        jwks = read_jwks_arg(a)
    else:
        jwks = None
    if jwks is None and not a.federated_subject:
        raise FixtureError("give --jwks, --jwks-json, --key or --generate (or --federated-subject)")
    with StateLock(d):
        s = load_state(d)
        fed_iss = a.federated_issuer or s["platform"]["issuer"]
        if a.federated_subject and fed_iss not in s["issuers"]:
            raise FixtureError(f"issuer {fed_iss!r} is not trusted (trust-issuer first)")
        rec = {"jwks": jwks or {"keys": []}, "scope": [SCOPE], "grant_types": a.grant or ["client_credentials", JWT_BEARER],
               "auth_methods": (["private_key_jwt"] if jwks else []) + (["federated_jwt"] if a.federated_subject else []),
               "federated": [{"issuer": fed_iss, "subject": sub} for sub in a.federated_subject or []],
               "key_file": key_file, "alg": alg}
        s["clients"][a.client] = rec
        save_state(d, s)
    jwks_file = os.path.join(d, f"client-{a.client}.jwks")
    write_private(jwks_file, json.dumps(rec["jwks"]))
    print(json.dumps({"client_id": a.client, "auth_methods": rec["auth_methods"], "grant_types": rec["grant_types"],
                      "kids": [k.get("kid") for k in rec["jwks"]["keys"]], "jwks_file": jwks_file,
                      "jwks_sha256": fingerprint(json.dumps(rec["jwks"], sort_keys=True)),
                      "key_file": key_file, "alg": alg, "federated": rec["federated"],
                      "audiences": s["audience"], "token_endpoint": s["token_endpoint"], "issuer": s["issuer"]}))


def cmd_trust_issuer(a):
    d = os.path.abspath(a.dir)
    jwks = read_jwks_arg(a)
    with StateLock(d):
        s = load_state(d)
        s["issuers"][a.issuer] = {"jwks": jwks, "subjects": a.subject or None}
        save_state(d, s)
    print(json.dumps({"issuer": a.issuer, "kids": [k.get("kid") for k in jwks["keys"]],
                      "subjects": a.subject or None, "jwks_sha256": fingerprint(json.dumps(jwks, sort_keys=True))}))


def mint(out, key, alg, kid, claims):
    token = sign_jwt(key, alg, claims, kid)
    write_atomically(out, token)
    print(json.dumps(dict(claims, alg=alg, kid=kid, out=os.path.abspath(out), sha256=fingerprint(token))))


def cmd_mint_platform_token(a):
    s = load_state(os.path.abspath(a.dir))
    p = s["platform"]
    now = int(time.time())
    claims = {"iss": a.iss or p["issuer"], "sub": a.sub, "aud": a.aud, "iat": now, "exp": now + a.lifetime}
    if not a.no_jti:
        claims["jti"] = a.jti or secrets.token_urlsafe(16)
    mint(a.out, import_private_key(p["key_file"]), a.alg or p["alg"], p["kid"], claims)


def cmd_mint_assertion(a):
    s = load_state(os.path.abspath(a.dir))
    c = s["clients"].get(a.client)
    if not c or not c.get("key_file"):
        raise FixtureError(f"client {a.client!r} is unknown or was registered without --key/--generate")
    key = import_private_key(c["key_file"])
    now = int(time.time())
    claims = {"iss": a.client, "sub": a.client, "aud": a.aud or s["issuer"], "iat": now,
              "exp": now + a.lifetime, "jti": a.jti or secrets.token_urlsafe(16)}
    mint(a.out, key, c["alg"] or default_alg(key), key.thumbprint(), claims)


def cmd_down(a):
    d = os.path.abspath(a.dir)
    try:
        with open(os.path.join(d, "server.pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        print("no pid file; nothing to stop", file=sys.stderr)
        return
    stop_pid(pid, lambda pid: pid_alive(pid, d))
    os.unlink(os.path.join(d, "server.pid"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up")
    p.add_argument("--dir", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--access-token-lifetime", type=int, default=3600)
    p.add_argument("--leeway", type=int, default=60, help="clock skew allowed on exp/nbf/iat (Authlib's default: 60)")
    p.add_argument("--max-assertion-lifetime", type=int, default=3600)
    p.add_argument("--audience", choices=["both", "issuer", "token-endpoint"], default="both")
    p.add_argument("--platform-issuer", default="https://platform.test")
    p.add_argument("--grant-replay", choices=["accept", "refuse"], default="accept")
    p.add_argument("--algs", default=",".join(DEFAULT_ALGS))
    p = sub.add_parser("serve")
    p.add_argument("--dir", required=True)
    p = sub.add_parser("register-client-keys")
    p.add_argument("--dir", required=True)
    p.add_argument("--client", required=True)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--jwks")
    g.add_argument("--jwks-json")
    g.add_argument("--key")
    g.add_argument("--generate", choices=["ES256", "RS256", "PS256"])
    p.add_argument("--alg", choices=["ES256", "RS256", "PS256"])
    p.add_argument("--grant", action="append", help=f"client_credentials, {JWT_BEARER} (default: both)")
    p.add_argument("--federated-subject", action="append")
    p.add_argument("--federated-issuer")
    p = sub.add_parser("trust-issuer")
    p.add_argument("--dir", required=True)
    p.add_argument("--issuer", required=True)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--jwks")
    g.add_argument("--jwks-json")
    p.add_argument("--subject", action="append")
    p = sub.add_parser("mint-platform-token")
    p.add_argument("--dir", required=True)
    p.add_argument("--sub", required=True)
    p.add_argument("--aud", required=True)
    p.add_argument("--lifetime", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--iss")
    p.add_argument("--jti")
    p.add_argument("--no-jti", action="store_true")
    p.add_argument("--alg", choices=["ES256"])
    p = sub.add_parser("mint-assertion")
    p.add_argument("--dir", required=True)
    p.add_argument("--client", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--aud")
    p.add_argument("--lifetime", type=int, default=60)
    p.add_argument("--jti")
    p = sub.add_parser("down")
    p.add_argument("--dir", required=True)
    a = ap.parse_args()
    if a.cmd != "down" and not in_venv():
        try:
            ensure_venv()
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"authlib_server {a.cmd}: cannot prepare {VENV}: {e}", file=sys.stderr)
            sys.exit(1)
        os.execv(venv_python(), [venv_python(), os.path.abspath(__file__), *sys.argv[1:]])
    if a.cmd == "serve":
        return serve(os.path.abspath(a.dir))
    fn = {"up": cmd_up, "register-client-keys": cmd_register_client_keys, "trust-issuer": cmd_trust_issuer,
          "mint-platform-token": cmd_mint_platform_token, "mint-assertion": cmd_mint_assertion,
          "down": cmd_down}[a.cmd]
    try:
        fn(a)
    except (FixtureError, OSError, subprocess.CalledProcessError, KeyError, ValueError) as e:
        print(f"authlib_server {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        if getattr(a, "started", False):
            try:
                with open(os.path.join(os.path.abspath(a.dir), "server.log"), errors="replace") as f:
                    print("--- server log tail ---\n" + "".join(f.readlines()[-30:]), file=sys.stderr)
                cmd_down(a)
            except Exception:
                pass
        sys.exit(1)


if __name__ == "__main__":
    main()
