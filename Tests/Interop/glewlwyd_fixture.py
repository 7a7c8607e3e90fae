#!/usr/bin/env python3
"""Headless Glewlwyd 2.7.5 (Debian 12 package) OAuth 2.0 server fixture for tests.

  up --dir DIR [--port P] [--access-token-duration S]   start + provision, print JSON
  refresh-token --dir DIR --client ID                     print one fresh refresh token
  approve-device --dir DIR --user-code CODE [--plugin P]  approve a device code as the user
  authorize --dir DIR --url URL [--plugin P]              play the browser for an authorization
                                                          URL as the user; print the redirect
  down --dir DIR                                          stop the server

Standard library only.  Secrets are never printed by `up`: they are written to
mode-0600 files under DIR whose paths are in the JSON.  The only command that
prints a credential is `refresh-token` (one line, meant to be piped); `authorize` prints the
redirect the browser would follow (it carries the authorization code) and nothing else.

Two OIDC plugin instances: `oidc` (the one the state's endpoints name; DPoP accepted, not
required) and `oidcnonce` (state["dpop_nonce_plugin"]: DPoP with a mandatory server nonce).
The code flow requires PKCE (S256 only); each client also has the loopback redirect URI
http://127.0.0.1:{state["code_redirect_port"]}/callback, a port free at `up` (Glewlwyd compares
redirect URIs as exact strings: a loopback client must listen on that very port).
"""
import argparse, base64, gzip, http.client as httpc, json, os, secrets, shutil
import signal, socket
import sqlite3, string, subprocess, sys, time, urllib.parse

HOST = "127.0.0.1"
SCOPE = "api"                      # the one custom scope granted to user and clients
# RFC 8707 resources the scope allows (resource-scope): a login may ask for them, and a refresh
# then name one of those its grant has (Glewlwyd ties them: `gpor_resource`).
RESOURCES = ["https://storage.example/api", "https://other.example/api"]
NONCE_PLUGIN = "oidcnonce"         # the second OIDC instance: DPoP with a mandatory nonce
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
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"glewlwyd" in argv[0] and (conf is None or conf.encode() in argv)


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


def client_auth(c):
    """(form fields, headers) authenticating client c with its own method."""
    if c["token_endpoint_auth_method"] == "client_secret_post":
        return {"client_id": c["client_id"], "client_secret": c["_secret"]}, {}
    raw = f"{c['client_id']}:{c['_secret']}".encode()  # [A-Za-z0-9] only: no encoding issue
    return {}, {"Authorization": "Basic " + base64.b64encode(raw).decode()}


def cmd_refresh_token(a):
    s = load_state(a.dir)
    c = next((c for c in s["clients"] if c["client_id"] == a.client), None)
    if c is None:
        raise FixtureError(f"unknown client {a.client!r}")
    form, hdr = client_auth(c)
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
    if pid_alive(pid, conf):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while pid_alive(pid, conf) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid, conf):
            os.kill(pid, signal.SIGKILL)
            while pid_alive(pid, conf):
                time.sleep(0.05)
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
    p = sub.add_parser("down")
    p.add_argument("--dir", required=True)
    a = ap.parse_args()
    fn = {"up": cmd_up, "refresh-token": cmd_refresh_token,
          "approve-device": cmd_approve_device, "authorize": cmd_authorize,
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
