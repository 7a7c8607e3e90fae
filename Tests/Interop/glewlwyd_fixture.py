#!/usr/bin/env python3
"""Headless Glewlwyd 2.7.5 (Debian 12 package) OAuth 2.0 server fixture for tests.

  up --dir DIR [--port P] [--access-token-duration S]   start + provision, print JSON
  refresh-token --dir DIR --client ID                     print one fresh refresh token
  approve-device --dir DIR --user-code CODE [--plugin P]  approve a device code as the user
  authorize --dir DIR --url URL [--plugin P]              play the browser for an authorization
                                                          URL as the user; print the redirect
  register-client-keys --dir DIR [--client ID] [--jwks FILE | --jwks-json TEXT] [--key PEM]
                       [--alg ES256|RS256|PS256]          (a JWKS, or --key, or both)
                                                          create/replace a private_key_jwt client
                                                          (default assertion-client); print JSON
  mint-assertion --dir DIR [--client ID] --out FILE [--aud A] [--plugin P] [--lifetime S]
                 [--jti J] [--alg A] [--kid K]            write a client assertion (0600, atomic)
  down --dir DIR                                          stop the server

Standard library only (and the openssl CLI, to sign client assertions).  Secrets are never
printed by `up`: they are written to mode-0600 files under DIR whose paths are in the JSON.  The
only command that prints a credential is `refresh-token` (one line, meant to be piped);
`authorize` prints the redirect the browser would follow (it carries the authorization code) and
nothing else; `mint-assertion` writes its JWT to --out and prints its claims and fingerprint.

private_key_jwt (RFC 7523 §2.2). Both plugin instances take JWT client authentication
(request-parameter-allow, client-jwks-parameter "jwks": a client's public keys are its `jwks`
property). `register-client-keys` makes a confidential client (scope api; the grants of the
secret clients: code, password, client_credentials, refresh_token, device, delete_token) whose
token_endpoint_auth_method is private_key_jwt only, with the JWKS given (or --key's public key,
kid = its RFC 7638 thumbprint); with --key (a PEM path, kept by path, never copied) this fixture
signs for it (openssl CLI: ES256 on P-256, RS256/PS256 on RSA): `refresh-token` then logs it in
with a fresh assertion, `mint-assertion` writes one to a file (what a platform would write for
ClientAssertionFile=). --alg sets the client's token_endpoint_signing_alg: another alg is refused.
What Glewlwyd 2.7.5 checks (validate_jwt_assertion_request, verify_request_signature; tried):
  * aud: one string, exactly the URL of the endpoint the assertion is sent to ({plugin}/token,
    /revoke, /introspect, /device_authorization): not the issuer, not an array;
  * iss = sub = an enabled confidential client's id (the form's client_id is not compared);
  * header kid: required, names a key of the client's JWKS (a key's own "alg" is not enforced);
    algs ES256/384/512, RS256/384/512, PS256/384/512, EdDSA (HS* = client_secret_jwt);
  * exp: required, not past (no leeway), at most request-maximum-exp (ASSERTION_MAX_LIFETIME,
    3600) ahead; iat and nbf are not checked;
  * jti: required, single-use per plugin and client, for ever (gpo_client_token_request): an
    assertion file is good for one request;
  * a refusal at the token endpoint is a 403 with an empty body (no invalid_client JSON); at
    /revoke and /introspect a 401, at /device_authorization a 401 {"error":"unauthorized_client"}.
Glewlwyd has no JWT-bearer grant (RFC 7523 §2.1): grant_type=urn:ietf:params:oauth:grant-type:
jwt-bearer is answered 400 with an empty body (authlib_server.py, beside this file, has one).

Two OIDC plugin instances: `oidc` (the one the state's endpoints name; DPoP accepted, not
required) and `oidcnonce` (state["dpop_nonce_plugin"]: DPoP with a mandatory server nonce).
The code flow requires PKCE (S256 only); each client also has the loopback redirect URI
http://127.0.0.1:{state["code_redirect_port"]}/callback, a port free at `up` (Glewlwyd compares
redirect URIs as exact strings: a loopback client must listen on that very port).
"""
import argparse, base64, gzip, hashlib, http.client as httpc, json, os, secrets, shutil
import socket
import sqlite3, string, subprocess, sys, time, urllib.parse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "PyCommon"))
from checks import fingerprint, process_argv, stop_pid  # noqa: E402

HOST = "127.0.0.1"
SCOPE = "api"                      # the one custom scope granted to user and clients
# RFC 8707 resources the scope allows (resource-scope): a login may ask for them, and a refresh
# then name one of those its grant has (Glewlwyd ties them: `gpor_resource`).
RESOURCES = ["https://storage.example/api", "https://other.example/api"]
NONCE_PLUGIN = "oidcnonce"         # the second OIDC instance: DPoP with a mandatory nonce
ASSERTION_CLIENT = "assertion-client"  # register-client-keys' default client (private_key_jwt)
# request-maximum-exp: Glewlwyd refuses a client assertion whose exp is more than this many
# seconds ahead (its default when unset is 3600 as well).
ASSERTION_MAX_LIFETIME = 3600
CLIENT_ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
USERNAME = "alice"
ADMIN = ("admin", "password")      # seeded by init.sqlite3.sql
COOKIE = "GLEWLWYD2_SESSION_ID"
# Schema + seed data; the dbconfig copy survives path-exclude=/usr/share/doc/*.
SQL_CANDIDATES = ["/usr/share/dbconfig-common/data/glewlwyd/install/sqlite3",
                  "/usr/share/doc/glewlwyd/database/init.sqlite3.sql.gz"]

CONF_TEMPLATE = """\
port={port}
bind_address="{host}"
external_url="{base}"
login_url="login.html"
api_prefix="api"
static_files_path="/usr/share/glewlwyd/webapp/"
allow_origin="*"
log_mode="console"
log_level="INFO"
cookie_domain="{host}"
cookie_secure=0
session_expiration=3600
session_key="{cookie}"
admin_session_authentication="cookie"
profile_session_authentication="cookie"
allow_multiple_user_per_session=true
login_api_enabled=true
max_post_size=16778240
admin_scope="g_admin"
profile_scope="g_profile"
user_module_path="/usr/lib/glewlwyd/user"
user_middleware_module_path="/usr/lib/glewlwyd/user_middleware"
client_module_path="/usr/lib/glewlwyd/client"
user_auth_scheme_module_path="/usr/lib/glewlwyd/scheme"
plugin_module_path="/usr/lib/glewlwyd/plugin"
hash_algorithm="SHA512"
database = {{ type = "sqlite3"  path = "{db}" }};
"""
# NB: no use_secure_connection line at all (even "= false" stops it starting).


class FixtureError(Exception):
    pass


# ---------------------------------------------------------------- helpers
def gen_secret(n=32):
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(n))


def write_private(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def req(port, method, path, body=None, headers=None, form=None, timeout=10):
    """One HTTP request, no redirect following. Returns (status, headers, bytes)."""
    headers = dict(headers or {})
    if form is not None:
        body = urllib.parse.urlencode(form)
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    elif body is not None and not isinstance(body, (str, bytes)):
        body = json.dumps(body)
        headers["Content-Type"] = "application/json"
    conn = httpc.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def login(port, username, password):
    """POST /api/auth/ and return a Cookie header value for the session."""
    st, hd, body = req(port, "POST", "/api/auth/",
                        {"username": username, "password": password})
    if st != 200:
        raise FixtureError(f"login as {username!r} failed: HTTP {st} {body[:200]!r}")
    for v in hd.get_all("Set-Cookie") or []:
        if v.startswith(COOKIE + "="):
            return v.split(";", 1)[0]
    raise FixtureError("login: no session cookie returned")


def log_tail(d, n=30):
    try:
        with open(os.path.join(d, "glewlwyd.log"), errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def load_state(d):
    try:
        with open(os.path.join(d, "fixture.json")) as f:
            return json.load(f)
    except OSError as e:
        raise FixtureError(f"no fixture state in {d} (was `up` run?): {e}")


def pid_alive(pid, conf=None):
    """True if pid runs glewlwyd (with our config) and is not a zombie."""
    argv = process_argv(pid)
    return argv is not None and b"glewlwyd" in argv[0] and (conf is None or conf.encode() in argv)


# ---------------------------------------------------------------- install
def ensure_installed():
    if shutil.which("glewlwyd"):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["debconf-set-selections"], check=True, text=True,
                   input="glewlwyd glewlwyd/config_type select No configuration\n")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends",
           "glewlwyd", "dbconfig-no-thanks"]
    out = sys.stderr  # keep stdout clean for the JSON
    if subprocess.run(cmd, env=env, stdout=out, stderr=out).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, stdout=out, stderr=out)
        subprocess.run(cmd, env=env, stdout=out, stderr=out, check=True)


def create_db(path):
    for src in SQL_CANDIDATES:
        if os.path.exists(src):
            opener = gzip.open if src.endswith(".gz") else open
            with opener(src, "rt") as f:
                sql = f.read()
            break
    else:
        raise FixtureError("init.sqlite3.sql not found (dpkg -L glewlwyd)")
    if os.path.exists(path):
        os.unlink(path)
    con = sqlite3.connect(path)
    con.executescript(sql)
    con.close()


def free_port(port=0):
    """Return port (or a kernel-picked one) after checking nobody listens on it,
    so liveness cannot be answered by some other server on that port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT
        try:
            s.bind((HOST, port))
        except OSError as e:
            raise FixtureError(f"port {port} on {HOST} is not free: {e}")
        return s.getsockname()[1]


# ---------------------------------------------------------------- JWTs signed with the openssl CLI
# Standard library + `openssl` (Debian's, in the Makefile's TEST_PACKAGES): ES256 (P-256), RS256
# and PS256 (RSA) client assertions for private_key_jwt.
SIGNING_ALGS = ("ES256", "RS256", "PS256")
P256_OID = bytes.fromhex("06082a8648ce3d030107")        # prime256v1


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def openssl(*args, data=None):
    out = subprocess.run(["openssl", *args], input=data, capture_output=True)
    if out.returncode != 0:
        raise FixtureError(f"openssl {args[0]} failed: {out.stderr.decode(errors='replace').strip()[:300]}")
    return out.stdout


def der_items(data):
    """The TLVs of a DER sequence's content: [(tag, value bytes)]."""
    items, i = [], 0
    while i < len(data):
        tag, length = data[i], data[i + 1]
        i += 2
        if length & 0x80:
            n = length & 0x7F
            length = int.from_bytes(data[i:i + n], "big")
            i += n
        items.append((tag, data[i:i + length]))
        i += length
    return items


def public_jwk(key_file):
    """The public JWK (kty, crv/x/y or n/e) of a PEM private key: EC P-256 or RSA."""
    spki = openssl("pkey", "-in", key_file, "-pubout", "-outform", "DER")
    (_, seq), = der_items(spki)
    (_, algid), (_, bits) = der_items(seq)
    point = bits[1:]                                   # BIT STRING: unused-bits byte first
    if P256_OID in algid:
        if len(point) != 65 or point[0] != 4:
            raise FixtureError("unexpected EC public key encoding")
        return {"kty": "EC", "crv": "P-256", "x": b64url(point[1:33]), "y": b64url(point[33:])}
    if bytes.fromhex("2a864886f70d010101") in algid:   # rsaEncryption
        (_, rsa), = der_items(point)
        (_, n), (_, e) = der_items(rsa)
        return {"kty": "RSA", "n": b64url(n.lstrip(b"\0")), "e": b64url(e.lstrip(b"\0"))}
    raise FixtureError(f"{key_file}: only EC P-256 and RSA keys are supported")


def jwk_thumbprint(jwk):
    """RFC 7638 SHA-256 thumbprint (base64url): the kid this fixture gives a derived JWK."""
    members = ("crv", "kty", "x", "y") if jwk["kty"] == "EC" else ("e", "kty", "n")
    canonical = json.dumps({k: jwk[k] for k in members}, separators=(",", ":"), sort_keys=True)
    return b64url(hashlib.sha256(canonical.encode()).digest())


def same_key(a, b):
    fields = ("kty", "crv", "x", "y") if a.get("kty") == "EC" else ("kty", "n", "e")
    return all(a.get(f) == b.get(f) for f in fields)


def sign_jwt(key_file, alg, header, claims):
    """A compact JWS of claims signed with key_file (ES256, RS256 or PS256)."""
    header = dict(header, alg=alg, typ=header.get("typ", "JWT"))
    signing_input = (b64url(json.dumps(header, separators=(",", ":")).encode()) + "." +
                     b64url(json.dumps(claims, separators=(",", ":")).encode())).encode()
    args = ["dgst", "-sha256", "-sign", key_file]
    if alg == "PS256":
        args += ["-sigopt", "rsa_padding_mode:pss", "-sigopt", "rsa_pss_saltlen:digest"]
    sig = openssl(*args, data=signing_input)
    if alg == "ES256":                                 # DER SEQUENCE{r, s} -> r || s (RFC 7518 §3.4)
        (_, seq), = der_items(sig)
        (_, r), (_, s) = der_items(seq)
        sig = r.lstrip(b"\0").rjust(32, b"\0") + s.lstrip(b"\0").rjust(32, b"\0")
    return signing_input.decode() + "." + b64url(sig)


def default_alg(jwk):
    return "ES256" if jwk["kty"] == "EC" else "RS256"


def write_atomically(path, text):
    """Writes path (mode 0600) through a temporary file in its directory and a rename, so a
    reader sees the old content or the new one, never a part."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write_private(tmp, text)
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------- provisioning
def oidc_plugin(base, at_duration, name="oidc", dpop_nonce=False):
    p = {
        "iss": f"{base}/api/{name}",  # so that discovery at ISSUER/.well-known/openid-configuration names it
        # HS256 with a random shared secret: no key files needed.
        "jwt-type": "sha", "jwt-key-size": "256", "key": gen_secret(48),
        "access-token-duration": at_duration,
        "refresh-token-duration": 1209600, "code-duration": 600,
        "refresh-token-rolling": True,
        "refresh-token-one-use": "always",         # rotation + reuse detection
        "allow-non-oidc": True,                     # password / client_credentials
        "auth-type-code-enabled": True, "auth-type-token-enabled": False,
        "auth-type-id-token-enabled": True, "auth-type-none-enabled": False,
        "auth-type-password-enabled": True, "auth-type-client-enabled": True,
        "auth-type-device-enabled": True, "auth-type-refresh-enabled": True,
        "scope": [], "additional-parameters": [], "claims": [],
        "allowed-scope": ["openid", SCOPE],
        "introspection-revocation-allowed": True,   # RFC 7662 / 7009
        "introspection-revocation-auth-scope": [],
        "introspection-revocation-allow-target-client": True,  # own credentials
        "device-authorization-expiration": 600, "device-authorization-interval": 5,
        "secret-type": "pairwise",
        # PKCE (RFC 7636). 2.7.5's parameter check knows pkce-allowed, pkce-method-plain-allowed,
        # pkce-mandatory, pkce-required, pkce-required-public-client and pkce-scopes, but its
        # authorization endpoint (is_code_challenge_valid) reads only pkce-allowed,
        # pkce-method-plain-allowed, pkce-required (every code request must carry a challenge),
        # pkce-required-public-client and pkce-scopes: pkce-mandatory is checked and never used.
        # A challenge is stored as "{SHA256}" + code_challenge (gpo_code.gpoc_code_challenge).
        "pkce-allowed": True, "pkce-method-plain-allowed": False, "pkce-required": True,
        # RFC 9207: the authorization response carries iss= (not advertised in discovery).
        "oauth-as-iss-id": True,
        # DPoP (RFC 9449). The keys 2.7.5's parameter check knows (libprotocol_oidc.so):
        # oauth-dpop-allowed; oauth-dpop-iat-duration (mandatory once allowed: a proof's
        # maximum age, s); oauth-dpop-iat-gap-duration (clock skew into the future, default 0);
        # oauth-dpop-nonce-mandatory with oauth-dpop-nonce-counter (mandatory then: each
        # successful proof counts it down, the one that finds 0 answers a new nonce in
        # DPoP-Nonce: a nonce serves counter+1 proofs; one nonce per client id, for the token
        # endpoint and userinfo alike, and per client id only: gpo_dpop_client_nonce has no
        # plugin column);
        # oauth-dpop-dpop_bound_access_tokens-property (a client property forcing DPoP).
        # Allowed, not required: requests without a DPoP header are served as before. In 2.7.5
        # the flag gates only discovery's dpop_signing_alg_values_supported (so DPoP=auto) and
        # the dpop_jkt authorization parameter: the token and userinfo endpoints verify and bind
        # proofs whether it is set or not (tried: with it false, the glwd-dpop checks pass).
        "oauth-dpop-allowed": True, "oauth-dpop-iat-duration": 60,
        # RFC 8707 resource indicators: a resource must be https (or loopback), without a
        # fragment, and allowed by a scope of the grant; requests that name none are as before.
        "resource-allowed": True, "resource-scope": {SCOPE: RESOURCES},
        "resource-client-property": "resource", "resource-scope-and-client-property": False,
        # JWT client authentication (RFC 7523 §2.2: client_secret_jwt, private_key_jwt). Gated by
        # request-parameter-allow (which also allows `request` objects at the authorization
        # endpoint and adds client_secret_jwt + private_key_jwt to discovery's
        # token_endpoint_auth_methods_supported). A client's public keys: its `jwks` property (the
        # database client module stores it as JSON, "convert": "jwks"). What 2.7.5 checks
        # (validate_jwt_assertion_request, verify_request_signature) is in register-client-keys.
        "request-parameter-allow": True,
        "request-maximum-exp": ASSERTION_MAX_LIFETIME,
        "client-jwks-parameter": "jwks",
    }
    if dpop_nonce:
        p.update({"oauth-dpop-nonce-mandatory": True, "oauth-dpop-nonce-counter": 1})
    return {"module": "oidc", "name": name, "display_name": name.upper(),
            "order_rank": 0, "readonly": False, "parameters": p}


def provision(port, base, at_duration, d, redirect_port):
    cookie = {"Cookie": login(port, *ADMIN)}

    def post(path, payload):
        st, _, body = req(port, "POST", path, payload, cookie)
        if st != 200:
            raise FixtureError(f"POST {path} -> HTTP {st} {body[:300]!r}")

    post("/api/mod/plugin/", oidc_plugin(base, at_duration))
    post("/api/mod/plugin/", oidc_plugin(base, at_duration, NONCE_PLUGIN, dpop_nonce=True))
    post("/api/scope/", {"name": SCOPE, "display_name": "Test API",
                         "description": "fixture scope", "password_required": False,
                         "password_max_age": 0, "scheme": {}})
    user_pw = gen_secret(24)
    post("/api/user/", {"username": USERNAME, "password": user_pw, "name": "Alice",
                        "email": "", "enabled": True, "scope": ["openid", SCOPE]})
    write_private(os.path.join(d, "user.password"), user_pw)
    clients = []
    for cid, method in (("postclient", "client_secret_post"),
                        ("basicclient", "client_secret_basic")):
        secret = gen_secret(32)
        post("/api/client/", {
            "client_id": cid, "name": cid, "description": "", "enabled": True,
            "confidential": True, "password": secret, "scope": [SCOPE],
            "redirect_uri": [base + "/cb", f"http://{HOST}:{redirect_port}/callback"],
            "authorization_type": ["code", "password", "client_credentials",
                                   "refresh_token", "device_authorization",
                                   "delete_token"],
            # Mandatory in practice (else e.g. the password grant answers 500);
            # Glewlwyd enforces it: the other method gets a bodyless 403.
            "token_endpoint_auth_method": [method]})
        path = os.path.join(d, f"client-{cid}.secret")
        write_private(path, secret)
        clients.append({"client_id": cid, "token_endpoint_auth_method": method,
                        "client_secret_file": path, "_secret": secret})
    return {"username": USERNAME, "password_file": os.path.join(d, "user.password"),
            "_password": user_pw}, clients


# ---------------------------------------------------------------- private_key_jwt clients
PRIVATE_JWK_MEMBERS = ("d", "p", "q", "dp", "dq", "qi", "oth", "k")


def read_jwks(a):
    """The JWKS to register: --jwks FILE or --jwks-json TEXT (a JWKS, or one JWK), else the public
    key of --key (kid: its RFC 7638 thumbprint)."""
    if a.jwks or a.jwks_json:
        if a.jwks:
            with open(a.jwks) as f:
                doc = json.load(f)
        else:
            doc = json.loads(a.jwks_json)
        keys = doc["keys"] if isinstance(doc, dict) and "keys" in doc else [doc]
    elif a.key:
        jwk = public_jwk(a.key)
        keys = [dict(jwk, kid=jwk_thumbprint(jwk), use="sig", alg=a.alg or default_alg(jwk))]
    else:
        raise FixtureError("give --jwks FILE, --jwks-json TEXT or --key PEM")
    if not keys or not all(isinstance(k, dict) and k.get("kty") for k in keys):
        raise FixtureError("not a JWKS: no keys, or a key without kty")
    for k in keys:
        if any(m in k for m in PRIVATE_JWK_MEMBERS):
            raise FixtureError(f"the JWKS holds private key material (kid {k.get('kid')!r}): register public keys only")
        if not k.get("kid"):
            # verify_request_signature looks a client's key up by the assertion's kid only.
            raise FixtureError("every key needs a kid: Glewlwyd finds the key by the assertion header's kid")
    return {"keys": keys}


def assertion_client_payload(s, cid, jwks, alg):
    c = {"client_id": cid, "name": cid, "description": "private_key_jwt (RFC 7523)", "enabled": True,
         "confidential": True, "scope": [SCOPE],
         "redirect_uri": [s["base_url"] + "/cb", f"http://{HOST}:{s['code_redirect_port']}/callback"],
         "authorization_type": ["code", "password", "client_credentials", "refresh_token",
                                "device_authorization", "delete_token"],
         "token_endpoint_auth_method": ["private_key_jwt"],
         "jwks": jwks}
    if alg:
        # Pins the assertion's alg: another alg (even with a valid signature) is refused.
        c["token_endpoint_signing_alg"] = alg
    return c


def cmd_register_client_keys(a):
    """Creates (or replaces) a confidential client that authenticates with private_key_jwt only,
    with the given public JWKS. --key (a PEM private key file, kept by path only) lets this
    fixture sign for it (mint-assertion, refresh-token); without --jwks its public key is the
    JWKS. Prints one JSON object; no secret."""
    s = load_state(a.dir)
    d = os.path.abspath(a.dir)
    jwks = read_jwks(a)
    key_file, kid = None, None
    if a.key:
        key_file = os.path.abspath(a.key)
        mine = public_jwk(key_file)
        match = [k for k in jwks["keys"] if same_key(k, mine)]
        if not match:
            raise FixtureError("--key's public key is not in the JWKS")
        kid = match[0]["kid"]
        if a.alg and (a.alg == "ES256") != (mine["kty"] == "EC"):
            raise FixtureError(f"--alg {a.alg} does not fit a {mine['kty']} key")
    port = s["port"]
    cookie = {"Cookie": login(port, *ADMIN)}
    payload = assertion_client_payload(s, a.client, jwks, a.alg)
    st, _, _ = req(port, "GET", f"/api/client/{urllib.parse.quote(a.client)}", headers=cookie)
    if st == 200:
        st, _, body = req(port, "PUT", f"/api/client/{urllib.parse.quote(a.client)}", payload, cookie)
    else:
        st, _, body = req(port, "POST", "/api/client/", payload, cookie)
    if st != 200:
        raise FixtureError(f"client {a.client!r} -> HTTP {st} {body[:300]!r}")
    jwks_file = os.path.join(d, f"client-{a.client}.jwks")
    write_private(jwks_file, json.dumps(jwks))
    entry = {"client_id": a.client, "token_endpoint_auth_method": "private_key_jwt",
             "jwks_file": jwks_file, "kids": [k["kid"] for k in jwks["keys"]],
             "token_endpoint_signing_alg": a.alg, "private_key_file": key_file, "kid": kid}
    s["clients"] = [c for c in s["clients"] if c["client_id"] != a.client] + [entry]
    write_private(os.path.join(d, "fixture.json"), json.dumps(s, indent=1))
    print(json.dumps(dict(entry,
                          # the aud Glewlwyd requires: exactly this string (not the issuer, not an array)
                          audience=s["token_endpoint"],
                          audience_nonce_plugin=s["dpop_nonce_plugin"]["token_endpoint"],
                          client_assertion_type=CLIENT_ASSERTION_TYPE,
                          max_assertion_lifetime=ASSERTION_MAX_LIFETIME,
                          jwks_sha256=fingerprint(json.dumps(jwks, sort_keys=True)))))


def assertion_for(s, c, aud=None, lifetime=60, jti=None, alg=None, kid=None):
    """(JWT, claims) a client assertion for private_key_jwt client c, signed with its key."""
    if not c.get("private_key_file"):
        raise FixtureError(f"client {c['client_id']!r} was registered without --key: this fixture cannot sign for it")
    alg = alg or c.get("token_endpoint_signing_alg") or default_alg(public_jwk(c["private_key_file"]))
    now = int(time.time())
    claims = {"iss": c["client_id"], "sub": c["client_id"], "aud": aud or s["token_endpoint"],
              "jti": jti or secrets.token_urlsafe(24), "iat": now, "exp": now + lifetime}
    return sign_jwt(c["private_key_file"], alg, {"kid": kid or c["kid"]}, claims), dict(claims, alg=alg, kid=kid or c["kid"])


def find_client(s, cid):
    c = next((c for c in s["clients"] if c["client_id"] == cid), None)
    if c is None:
        raise FixtureError(f"unknown client {cid!r}")
    return c


def cmd_mint_assertion(a):
    """Writes a fresh client assertion for a private_key_jwt client (registered with --key) to
    --out, atomically, mode 0600: what a platform writes for ClientAssertionFile=. Prints JSON:
    the file, the JWT's fingerprint and its claims (no signature)."""
    s = load_state(a.dir)
    c = find_client(s, a.client)
    aud = a.aud or (s["dpop_nonce_plugin"]["token_endpoint"] if a.plugin == NONCE_PLUGIN else s["token_endpoint"])
    jwt, claims = assertion_for(s, c, aud, a.lifetime, a.jti, a.alg, a.kid)
    write_atomically(a.out, jwt)
    print(json.dumps(dict(claims, out=os.path.abspath(a.out), sha256=fingerprint(jwt))))


# ---------------------------------------------------------------- commands
def cmd_up(a):
    t0 = time.monotonic()
    d = os.path.abspath(a.dir)
    os.makedirs(d, exist_ok=True)
    pidfile = os.path.join(d, "glewlwyd.pid")
    conf = os.path.join(d, "glewlwyd.conf")
    if os.path.exists(pidfile):
        with open(pidfile) as f:
            if pid_alive(int(f.read().strip() or 0), conf):
                raise FixtureError(f"a server from {d} is already running; run `down` first")
    ensure_installed()
    port = free_port(a.port)
    base = f"http://{HOST}:{port}"
    db = os.path.join(d, "glewlwyd.db")
    create_db(db)
    with open(conf, "w") as f:
        f.write(CONF_TEMPLATE.format(port=port, host=HOST, base=base, db=db, cookie=COOKIE))
    log = open(os.path.join(d, "glewlwyd.log"), "wb")
    proc = subprocess.Popen(["glewlwyd", "-c", conf], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=d)
    with open(pidfile, "w") as f:
        f.write(f"{proc.pid}\n")
    a.started = True          # from here on, a failure stops this server
    # Liveness: GET /config answers 200 once the HTTP server is up.
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise FixtureError(f"glewlwyd exited with {proc.returncode} during startup")
        try:
            if req(port, "GET", "/config", timeout=1)[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise FixtureError("glewlwyd not live within 20 s")
        time.sleep(0.05)
    redirect_port = free_port()      # Glewlwyd holds `port`: this one differs
    user, clients = provision(port, base, a.access_token_duration, d, redirect_port)
    discovery = {}
    for plugin in ("oidc", NONCE_PLUGIN):
        st, _, body = req(port, "GET", f"/api/{plugin}/.well-known/openid-configuration")
        if st != 200:
            raise FixtureError(f"discovery of {plugin} -> HTTP {st}")
        discovery[plugin] = json.loads(body)
    disc, ndisc = discovery["oidc"], discovery[NONCE_PLUGIN]
    state = {
        "base_url": base, "port": port, "pid": proc.pid,
        "issuer": disc["issuer"],
        "discovery_url": base + "/api/oidc/.well-known/openid-configuration",
        "token_endpoint": disc["token_endpoint"],
        "authorization_endpoint": disc["authorization_endpoint"],
        "code_redirect_port": redirect_port,   # every client's http://127.0.0.1:PORT/callback
        "code_challenge_methods_supported": disc.get("code_challenge_methods_supported"),
        "revocation_endpoint": disc.get("revocation_endpoint"),
        "introspection_endpoint": disc.get("introspection_endpoint"),
        "device_authorization_endpoint": disc.get("device_authorization_endpoint"),
        "userinfo_endpoint": disc.get("userinfo_endpoint"),
        "dpop_signing_alg_values_supported": disc.get("dpop_signing_alg_values_supported"),
        # private_key_jwt (register-client-keys): a client assertion's aud must be exactly the URL
        # of the endpoint it is sent to (the token endpoint for /token).
        "token_endpoint_auth_methods_supported": disc.get("token_endpoint_auth_methods_supported"),
        "token_endpoint_auth_signing_alg_values_supported": disc.get("token_endpoint_auth_signing_alg_values_supported"),
        "client_assertion_max_lifetime": ASSERTION_MAX_LIFETIME,
        "dpop_nonce_plugin": {"name": NONCE_PLUGIN, "issuer": ndisc["issuer"],
                              "token_endpoint": ndisc["token_endpoint"],
                              "userinfo_endpoint": ndisc.get("userinfo_endpoint"),
                              "revocation_endpoint": ndisc.get("revocation_endpoint"),
                              "device_authorization_endpoint": ndisc.get("device_authorization_endpoint")},
        "database": db,         # SQLite: tests may read it (read-only) for Glewlwyd's own records
        "scope": SCOPE, "access_token_duration": a.access_token_duration,
        "user": user, "clients": clients,
        "log_file": os.path.join(d, "glewlwyd.log"),
    }
    write_private(os.path.join(d, "fixture.json"), json.dumps(state, indent=1))
    public = json.loads(json.dumps(state))            # strip "_secret"-style keys
    public["user"].pop("_password")
    for c in public["clients"]:
        c.pop("_secret")
    public["up_seconds"] = round(time.monotonic() - t0, 3)
    print(json.dumps(public))


def client_auth(c, s=None):
    """(form fields, headers) authenticating client c with its own method (private_key_jwt: a
    fresh assertion for state s's token endpoint)."""
    if c["token_endpoint_auth_method"] == "private_key_jwt":
        jwt, _ = assertion_for(s, c)
        return {"client_id": c["client_id"], "client_assertion_type": CLIENT_ASSERTION_TYPE,
                "client_assertion": jwt}, {}
    if c["token_endpoint_auth_method"] == "client_secret_post":
        return {"client_id": c["client_id"], "client_secret": c["_secret"]}, {}
    raw = f"{c['client_id']}:{c['_secret']}".encode()  # [A-Za-z0-9] only: no encoding issue
    return {}, {"Authorization": "Basic " + base64.b64encode(raw).decode()}


def cmd_refresh_token(a):
    s = load_state(a.dir)
    c = find_client(s, a.client)
    form, hdr = client_auth(c, s)
    form.update(grant_type="password", username=s["user"]["username"],
                password=s["user"]["_password"], scope=s["scope"])
    path = urllib.parse.urlsplit(s["token_endpoint"]).path
    st, _, body = req(s["port"], "POST", path, headers=hdr, form=form)
    if st != 200:
        raise FixtureError(f"password grant -> HTTP {st} (body {len(body)} bytes)")
    print(json.loads(body)["refresh_token"])


def cmd_approve_device(a):
    """Approve a device user code as the fixture user, using only REST calls:
    login, read the request's client/scope from the verification redirect,
    grant those scopes to the client, then hit the verification URL with
    g_continue (what the login page would do)."""
    s = load_state(a.dir)
    port = s["port"]
    cookie = {"Cookie": login(port, s["user"]["username"], s["user"]["_password"])}
    vpath = f"/api/{a.plugin}/device?code=" + urllib.parse.quote(a.user_code)
    st, hd, _ = req(port, "GET", vpath, headers=cookie)
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(hd.get("Location", "")).query)
    if st != 302 or "client_id" not in q:
        raise FixtureError(f"user code rejected (HTTP {st}, prompt={q.get('prompt')})")
    client_id, scope = q["client_id"][0], q.get("scope", [""])[0]
    st, _, body = req(port, "PUT", f"/api/auth/grant/{urllib.parse.quote(client_id)}/",
                       {"scope": scope}, cookie)  # space-separated: scope.c splits on " "
    if st != 200:
        raise FixtureError(f"grant scopes -> HTTP {st} {body[:200]!r}")
    st, hd, _ = req(port, "GET", vpath + "&g_continue", headers=cookie)
    prompt = urllib.parse.parse_qs(urllib.parse.urlsplit(hd.get("Location", "")).query).get("prompt")
    if prompt != ["deviceComplete"]:
        raise FixtureError(f"device approval failed (HTTP {st}, prompt={prompt})")
    print(json.dumps({"approved": True, "client_id": client_id, "scope": scope}))


def cmd_authorize(a):
    """Play the browser for an authorization URL (response_type=code) as the fixture user, with
    REST calls only: log in (cookie), GET the URL at Glewlwyd; without g_continue it always sends
    the browser to its login page (login.html?...&client_id=...&scope=...), so grant those scopes
    to the client (what the page's consent step does) and GET the URL again with g_continue (what
    the page does once done). The answer must be a 302 to the URL's redirect_uri: its Location
    (the code, or an error) is printed, one line. Errors name HTTP statuses and prompts only."""
    s = load_state(a.dir)
    port = s["port"]
    url = urllib.parse.urlsplit(a.url)
    if url.scheme != "http" or url.hostname != HOST or url.port != port \
            or not url.path.startswith(f"/api/{a.plugin}/"):
        raise FixtureError(f"not an authorization URL of this server's {a.plugin} plugin")
    q = urllib.parse.parse_qs(url.query)
    redirect_uri = q.get("redirect_uri", [""])[0]
    if not redirect_uri:
        raise FixtureError("the authorization URL has no redirect_uri")
    cookie = {"Cookie": login(port, s["user"]["username"], s["user"]["_password"])}
    target = url.path + "?" + url.query

    def final(st, hd):
        location = hd.get("Location", "")
        return st == 302 and location.startswith(redirect_uri) and \
            location[len(redirect_uri):len(redirect_uri) + 1] in ("", "?")

    st, hd, _ = req(port, "GET", target, headers=cookie)
    if not final(st, hd):
        lq = urllib.parse.parse_qs(urllib.parse.urlsplit(hd.get("Location", "")).query)
        if st != 302 or "client_id" not in lq:
            raise FixtureError(f"authorization request refused (HTTP {st}, prompt={lq.get('prompt')})")
        client_id = lq["client_id"][0]
        scope = lq.get("scope", q.get("scope", [""]))[0]
        st, _, body = req(port, "PUT", f"/api/auth/grant/{urllib.parse.quote(client_id)}/",
                          {"scope": scope}, cookie)
        if st != 200:
            raise FixtureError(f"grant scopes -> HTTP {st}")
        st, hd, _ = req(port, "GET", target + "&g_continue", headers=cookie)
        if not final(st, hd):
            lq = urllib.parse.parse_qs(urllib.parse.urlsplit(hd.get("Location", "")).query)
            raise FixtureError(f"authorization not granted (HTTP {st}, prompt={lq.get('prompt')})")
    location = hd["Location"]
    error = urllib.parse.parse_qs(urllib.parse.urlsplit(location).query).get("error")
    if error:
        print(f"glewlwyd_fixture authorize: the redirect carries error={error[0]}", file=sys.stderr)
    print(location)


def cmd_down(a):
    d = os.path.abspath(a.dir)
    try:
        with open(os.path.join(d, "glewlwyd.pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        print("no pid file; nothing to stop", file=sys.stderr)
        return
    conf = os.path.join(d, "glewlwyd.conf")
    stop_pid(pid, lambda pid: pid_alive(pid, conf))
    os.unlink(os.path.join(d, "glewlwyd.pid"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up")
    p.add_argument("--dir", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--access-token-duration", type=int, default=3600)
    p = sub.add_parser("refresh-token")
    p.add_argument("--dir", required=True)
    p.add_argument("--client", required=True)
    p = sub.add_parser("approve-device")
    p.add_argument("--dir", required=True)
    p.add_argument("--user-code", required=True)
    p.add_argument("--plugin", default="oidc", choices=["oidc", NONCE_PLUGIN])
    p = sub.add_parser("authorize")
    p.add_argument("--dir", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--plugin", default="oidc", choices=["oidc", NONCE_PLUGIN])
    p = sub.add_parser("register-client-keys")
    p.add_argument("--dir", required=True)
    p.add_argument("--client", default=ASSERTION_CLIENT)
    p.add_argument("--jwks", help="a file holding the public JWKS (or one JWK)")
    p.add_argument("--jwks-json", help="the public JWKS (or one JWK) itself")
    p.add_argument("--key", help="a PEM private key (EC P-256 or RSA) the fixture may sign with")
    p.add_argument("--alg", choices=SIGNING_ALGS, help="pin the client's token_endpoint_signing_alg")
    p = sub.add_parser("mint-assertion")
    p.add_argument("--dir", required=True)
    p.add_argument("--client", default=ASSERTION_CLIENT)
    p.add_argument("--out", required=True)
    p.add_argument("--aud", help="default: the plugin's token endpoint (what Glewlwyd requires)")
    p.add_argument("--plugin", default="oidc", choices=["oidc", NONCE_PLUGIN])
    p.add_argument("--lifetime", type=int, default=60)
    p.add_argument("--jti")
    p.add_argument("--alg", choices=SIGNING_ALGS)
    p.add_argument("--kid")
    p = sub.add_parser("down")
    p.add_argument("--dir", required=True)
    a = ap.parse_args()
    fn = {"up": cmd_up, "refresh-token": cmd_refresh_token,
          "approve-device": cmd_approve_device, "authorize": cmd_authorize,
          "register-client-keys": cmd_register_client_keys, "mint-assertion": cmd_mint_assertion,
          "down": cmd_down}[a.cmd]
    try:
        fn(a)
    except (FixtureError, OSError, subprocess.CalledProcessError, KeyError,
            ValueError) as e:
        print(f"glewlwyd_fixture {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        print("--- glewlwyd log tail ---\n" + log_tail(os.path.abspath(a.dir)),
              file=sys.stderr)
        if getattr(a, "started", False):  # don't leave a half-provisioned server
            try:
                cmd_down(a)
            except Exception:
                pass
        sys.exit(1)


if __name__ == "__main__":
    main()
