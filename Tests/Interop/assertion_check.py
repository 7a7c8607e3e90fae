#!/usr/bin/env python3
"""The JWT-assertion servers by themselves, no tokenbroker: what Glewlwyd 2.7.5 and the Authlib
server (authlib_server.py) verify for RFC 7523, shown with assertions signed here (Python
`cryptography`, independent of the fixtures' own signers).

    assertion_check.py [glewlwyd|authlib ...]     (default: both)

Glewlwyd: private_key_jwt (ES256, RS256, PS256; aud must be the token endpoint, exactly; jti
single-use; exp at most request-maximum-exp ahead), client_credentials, a refresh token for the
client (refresh-token) refreshed with a fresh assertion, a ClientAssertionFile-style file from
`mint-assertion` (accepted once), and no JWT-bearer grant. Authlib: private_key_jwt (aud: issuer or
token endpoint), replay/expiry/lifetime refusals, the JWT-bearer grant with platform tokens from
`mint-platform-token` (no refresh token), optional client authentication with it, a federated
client assertion, and --grant-replay refuse / --audience token-endpoint.

Runs under the Authlib fixture's venv (re-executes itself there: it needs `cryptography`). Exit 0
when every check passed, 1 otherwise; Glewlwyd checks are skipped (SKIP line) when it cannot be
installed. No token or key is printed: tokens are named by a short fingerprint.
"""
import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "PyCommon"))
sys.path.insert(0, HERE)
import authlib_server  # noqa: E402  (the venv's location and pins)
from checks import FAILURES, check, fingerprint  # noqa: E402

GLEWLWYD = os.path.join(HERE, "glewlwyd_fixture.py")
AUTHLIB = os.path.join(HERE, "authlib_server.py")
CAT = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"


def b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Key:
    """A signing key made here: EC P-256 (ES256) or RSA 2048 (RS256/PS256)."""

    def __init__(self, kind, directory, kid):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        self.kind, self.kid = kind, kid
        self.key = ec.generate_private_key(ec.SECP256R1()) if kind == "EC" else rsa.generate_private_key(65537, 2048)
        self.pem = os.path.join(directory, f"{kid}.pem")
        fd = os.open(self.pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))

    def jwk(self):
        n = self.key.public_key().public_numbers()
        if self.kind == "EC":
            return {"kty": "EC", "crv": "P-256", "x": b64(n.x.to_bytes(32, "big")), "y": b64(n.y.to_bytes(32, "big")),
                    "kid": self.kid, "use": "sig"}
        return {"kty": "RSA", "n": b64(n.n.to_bytes((n.n.bit_length() + 7) // 8, "big")), "e": b64(n.e.to_bytes(3, "big")),
                "kid": self.kid, "use": "sig"}

    def sign(self, alg, claims, kid=True):
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec, padding, utils
        header = {"alg": alg, "typ": "JWT"}
        if kid:
            header["kid"] = self.kid
        signing_input = (b64(json.dumps(header).encode()) + "." + b64(json.dumps(claims).encode())).encode()
        if alg == "ES256":
            r, s = utils.decode_dss_signature(self.key.sign(signing_input, ec.ECDSA(hashes.SHA256())))
            sig = r.to_bytes(32, "big") + s.to_bytes(32, "big")
        elif alg == "RS256":
            sig = self.key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
        else:
            sig = self.key.sign(signing_input, padding.PSS(padding.MGF1(hashes.SHA256()), 32), hashes.SHA256())
        return signing_input.decode() + "." + b64(sig)


def claims(iss, aud, lifetime=60, sub=None, jti=True, **extra):
    now = int(time.time())
    c = {"iss": iss, "sub": sub or iss, "aud": aud, "iat": now, "exp": now + lifetime}
    if jti:
        c["jti"] = secrets.token_urlsafe(16)
    c.update(extra)
    return c


def post(url, form, headers=None):
    """(HTTP status, JSON object or {}): bodies stay here, tokens are only fingerprinted."""
    data = urllib.parse.urlencode(form).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers or {}), timeout=10) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        answer = json.loads(body)
    except ValueError:
        answer = {}
    return status, answer if isinstance(answer, dict) else {}


def fixture(script, *args):
    out = subprocess.run([sys.executable, script, *args],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{os.path.basename(script)} {args[0]}: {out.stderr.strip()[-800:]}")
    return out.stdout.strip()


def summary(answer):
    return {k: (fingerprint(v) if k in ("access_token", "refresh_token", "id_token") else v) for k, v in answer.items()}


# ---------------------------------------------------------------- Glewlwyd
def glewlwyd(tmp):
    d = os.path.join(tmp, "glewlwyd")
    t0 = time.monotonic()
    try:
        info = json.loads(fixture(GLEWLWYD, "up", "--dir", d))
    except RuntimeError as e:
        if not shutil.which("glewlwyd"):
            print(f"SKIP glewlwyd: cannot be installed here: {str(e)[-300:]}")
            return
        raise
    print(f"glewlwyd up in {time.monotonic() - t0:.2f} s ({info['up_seconds']} s inside)")
    try:
        te, issuer = info["token_endpoint"], info["issuer"]
        ec_key, rsa_key = Key("EC", tmp, "gw-ec"), Key("RSA", tmp, "gw-rsa")
        jwks = os.path.join(tmp, "gw.jwks")
        with open(jwks, "w") as f:
            json.dump({"keys": [ec_key.jwk(), rsa_key.jwk()]}, f)
        reg = json.loads(fixture(GLEWLWYD, "register-client-keys", "--dir", d, "--jwks", jwks, "--key", ec_key.pem))
        check(reg["audience"] == te and reg["kid"] == "gw-ec",
              "glewlwyd: register-client-keys registers assertion-client (private_key_jwt) with the JWKS", json.dumps(reg)[:300])
        cid = reg["client_id"]

        def cc(jwt, **form):
            return post(te, dict({"grant_type": "client_credentials", "scope": "api", "client_id": cid,
                                  "client_assertion_type": CAT, "client_assertion": jwt}, **form))

        good = ec_key.sign("ES256", claims(cid, te))
        st, ans = cc(good)
        check(st == 200 and ans.get("access_token") and "refresh_token" not in ans,
              f"glewlwyd: ES256 assertion, aud = token endpoint -> client_credentials token {summary(ans)}", str(st))
        st, _ = cc(good)
        check(st == 403, "glewlwyd: the same assertion again (jti replay) -> 403", str(st))
        for name, jwt in [("aud = issuer", ec_key.sign("ES256", claims(cid, issuer))),
                          ("aud = [token endpoint] (array)", ec_key.sign("ES256", claims(cid, [te]))),
                          ("no jti", ec_key.sign("ES256", claims(cid, te, jti=False))),
                          ("exp 3700 s ahead (> request-maximum-exp 3600)", ec_key.sign("ES256", claims(cid, te, lifetime=3700))),
                          ("expired 5 s ago", ec_key.sign("ES256", claims(cid, te, lifetime=-5))),
                          ("no kid in the header", ec_key.sign("ES256", claims(cid, te), kid=False)),
                          ("sub != iss", ec_key.sign("ES256", claims(cid, te, sub="someone-else")))]:
            st, ans = cc(jwt)
            check(st == 403 and not ans, f"glewlwyd: {name} -> 403 with an empty body", f"{st} {ans}")
        for alg in ("RS256", "PS256"):
            st, ans = cc(rsa_key.sign(alg, claims(cid, te)))
            check(st == 200 and ans.get("access_token"), f"glewlwyd: {alg} (RSA key of the JWKS) -> token", str(st))
        st, ans = cc(ec_key.sign("ES256", claims(cid, te)), client_id="postclient")
        check(st == 200, "glewlwyd: a form client_id naming another client is ignored (iss decides) -> 200", str(st))
        st, ans = cc(ec_key.sign("ES256", claims(cid, te)), grant_type=JWT_BEARER,
                     assertion=ec_key.sign("ES256", claims(cid, te)))
        check(st == 400 and not ans, "glewlwyd: grant_type=jwt-bearer is unknown -> 400 with an empty body", f"{st} {ans}")

        rt = fixture(GLEWLWYD, "refresh-token", "--dir", d, "--client", cid)
        st, ans = post(te, {"grant_type": "refresh_token", "refresh_token": rt, "client_assertion_type": CAT,
                            "client_assertion": ec_key.sign("ES256", claims(cid, te))})
        check(st == 200 and ans.get("refresh_token") not in (None, rt),
              f"glewlwyd: refresh-token for assertion-client, refreshed with a fresh assertion (rotated) {summary(ans)}", str(st))

        path = os.path.join(tmp, "gw-assertion.jwt")
        minted = json.loads(fixture(GLEWLWYD, "mint-assertion", "--dir", d, "--out", path))
        mode = os.stat(path).st_mode & 0o777
        with open(path) as f:
            jwt = f.read()
        check(mode == 0o600 and minted["sha256"] == fingerprint(jwt) and minted["aud"] == te,
              f"glewlwyd: mint-assertion writes the file 0600 ({oct(mode)}), aud = token endpoint")
        first, second = cc(jwt)[0], cc(jwt)[0]
        check(first == 200 and second == 403,
              f"glewlwyd: a file assertion is good once: {first}, then {second} (jti replay)")
    finally:
        fixture(GLEWLWYD, "down", "--dir", d)


# ---------------------------------------------------------------- Authlib
def authlib(tmp):
    d = os.path.join(tmp, "authlib")
    t0 = time.monotonic()
    info = json.loads(fixture(AUTHLIB, "up", "--dir", d))
    print(f"authlib server up in {time.monotonic() - t0:.2f} s ({info['up_seconds']} s inside), versions {info['versions']}")
    try:
        te, issuer, platform = info["token_endpoint"], info["issuer"], info["platform"]["issuer"]
        with urllib.request.urlopen(info["metadata_url"], timeout=5) as r:
            meta = json.load(r)
        check(meta["issuer"] == issuer and "private_key_jwt" in meta["token_endpoint_auth_methods_supported"]
              and JWT_BEARER in meta["grant_types_supported"]
              and meta["token_endpoint_auth_signing_alg_values_supported"] == ["ES256", "RS256", "PS256"],
              "authlib: RFC 8414 metadata (issuer = base URL, private_key_jwt, jwt-bearer, ES256/RS256/PS256)")
        ec_key, rsa_key = Key("EC", tmp, "al-ec"), Key("RSA", tmp, "al-rsa")
        jwks = os.path.join(tmp, "al.jwks")
        with open(jwks, "w") as f:
            json.dump({"keys": [ec_key.jwk(), rsa_key.jwk()]}, f)
        cid = "assertion-client"
        reg = json.loads(fixture(AUTHLIB, "register-client-keys", "--dir", d, "--client", cid, "--jwks", jwks))
        check(reg["kids"] == ["al-ec", "al-rsa"], "authlib: register-client-keys --jwks", json.dumps(reg)[:200])

        def cc(jwt, **form):
            return post(te, dict({"grant_type": "client_credentials", "scope": "api",
                                  "client_assertion_type": CAT, "client_assertion": jwt}, **form))

        good = ec_key.sign("ES256", claims(cid, issuer))
        st, ans = cc(good)
        check(st == 200 and ans.get("access_token") and "refresh_token" not in ans,
              f"authlib: private_key_jwt ES256, aud = issuer -> client_credentials token {summary(ans)}", str(st))
        st, ans = cc(good)
        check(st == 400 and ans.get("error") == "invalid_client" and "used before" in ans.get("error_description", ""),
              f"authlib: the same assertion again -> 400 invalid_client ({ans.get('error_description')})", str(st))
        st, ans = cc(ec_key.sign("ES256", claims(cid, te)))
        check(st == 200, "authlib: aud = token endpoint -> token", str(st))
        st, ans = cc(ec_key.sign("ES256", claims(cid, [issuer, "https://else.example"])))
        check(st == 200, "authlib: aud = [issuer, another] (array) -> token", str(st))
        for alg in ("RS256", "PS256"):
            st, ans = cc(rsa_key.sign(alg, claims(cid, issuer)))
            check(st == 200, f"authlib: {alg} -> token", f"{st} {ans}")
        for name, jwt in [("expired 120 s ago (leeway 60)", ec_key.sign("ES256", claims(cid, issuer, lifetime=-120))),
                          ("exp 3700 s ahead (> 3600)", ec_key.sign("ES256", claims(cid, issuer, lifetime=3700))),
                          ("aud = another server", ec_key.sign("ES256", claims(cid, "https://else.example"))),
                          ("no jti", ec_key.sign("ES256", claims(cid, issuer, jti=False))),
                          ("sub != iss", ec_key.sign("ES256", claims(cid, issuer, sub="x"))),
                          ("signed by a key not registered", Key("EC", tmp, "al-other").sign("ES256", claims(cid, issuer)))]:
            st, ans = cc(jwt)
            check(st in (400, 401) and ans.get("error") == "invalid_client",
                  f"authlib: {name} -> {st} invalid_client ({ans.get('error_description')})", f"{st} {ans}")

        # The JWT-bearer grant with the platform's tokens.
        path = os.path.join(tmp, "platform.jwt")
        minted = json.loads(fixture(AUTHLIB, "mint-platform-token", "--dir", d, "--sub", "workload-1", "--aud", issuer,
                                    "--lifetime", "300", "--out", path))
        with open(path) as f:
            platform_jwt = f.read()
        check(os.stat(path).st_mode & 0o777 == 0o600 and minted["iss"] == platform and minted["sha256"] == fingerprint(platform_jwt),
              "authlib: mint-platform-token writes a 0600 file")
        st, ans = post(te, {"grant_type": JWT_BEARER, "assertion": platform_jwt, "scope": "api"})
        check(st == 200 and ans.get("access_token") and "refresh_token" not in ans,
              f"authlib: jwt-bearer grant, no client authentication -> token, no refresh token {summary(ans)}", f"{st} {ans}")
        st, ans = post(te, {"grant_type": JWT_BEARER, "assertion": platform_jwt})
        check(st == 200, "authlib: the same platform token again -> token (--grant-replay accept)", str(st))
        st, ans = post(te, {"grant_type": JWT_BEARER, "assertion": platform_jwt, "client_assertion_type": CAT,
                            "client_assertion": ec_key.sign("ES256", claims(cid, issuer))})
        with open(info["events_file"]) as f:
            last = json.loads(f.read().splitlines()[-1])
        check(st == 200 and last["client_id"] == cid and last["auth_method"] == "private_key_jwt" and last["sub"] == "workload-1",
              "authlib: jwt-bearer grant with private_key_jwt -> the client's token (events.jsonl)", json.dumps(last)[:300])
        st, ans = post(te, {"grant_type": JWT_BEARER, "assertion": platform_jwt, "client_assertion_type": CAT,
                            "client_assertion": ec_key.sign("ES256", claims(cid, "https://else.example"))})
        check(st in (400, 401) and ans.get("error") == "invalid_client",
              "authlib: jwt-bearer grant with a bad client assertion -> invalid_client", f"{st} {ans}")
        for name, args in [("expired (lifetime -120)", ["--sub", "w", "--aud", issuer, "--lifetime", "-120"]),
                           ("aud = another server", ["--sub", "w", "--aud", "https://else.example", "--lifetime", "300"]),
                           ("iss not trusted", ["--sub", "w", "--aud", issuer, "--lifetime", "300", "--iss", "https://rogue.test"]),
                           ("exp 7200 s ahead", ["--sub", "w", "--aud", issuer, "--lifetime", "7200"])]:
            fixture(AUTHLIB, "mint-platform-token", "--dir", d, "--out", path, *args)
            with open(path) as f:
                jwt = f.read()
            st, ans = post(te, {"grant_type": JWT_BEARER, "assertion": jwt})
            check(st == 400 and ans.get("error") == "invalid_grant",
                  f"authlib: jwt-bearer, {name} -> 400 invalid_grant ({ans.get('error_description')})", f"{st} {ans}")

        # A federated client assertion: the platform's token as client_assertion for fed-client.
        fixture(AUTHLIB, "register-client-keys", "--dir", d, "--client", "fed-client", "--federated-subject", "workload-1")
        fixture(AUTHLIB, "mint-platform-token", "--dir", d, "--sub", "workload-1", "--aud", issuer, "--lifetime", "300", "--out", path)
        with open(path) as f:
            jwt = f.read()
        st1, _ = cc(jwt)
        st2, _ = cc(jwt, client_id="fed-client")
        with open(info["events_file"]) as f:
            last = json.loads(f.read().splitlines()[-1])
        check(st1 == 200 and st2 == 200 and last["client_id"] == "fed-client" and last["auth_method"] == "federated_jwt",
              f"authlib: platform token as client_assertion (federated, fed-client) -> token, twice ({st1}, {st2})")
        fixture(AUTHLIB, "mint-platform-token", "--dir", d, "--sub", "workload-2", "--aud", issuer, "--lifetime", "300", "--out", path)
        with open(path) as f:
            st, ans = cc(f.read())
        check(st in (400, 401) and ans.get("error") == "invalid_client",
              "authlib: platform token for an unbound subject as client_assertion -> invalid_client", f"{st} {ans}")

        # mint-assertion (the fixture's signer, a --generate'd key).
        fixture(AUTHLIB, "register-client-keys", "--dir", d, "--client", "gen-client", "--generate", "PS256")
        fixture(AUTHLIB, "mint-assertion", "--dir", d, "--client", "gen-client", "--out", path)
        with open(path) as f:
            st, _ = cc(f.read())
        check(st == 200, "authlib: register-client-keys --generate PS256 + mint-assertion -> token", str(st))
        with open(info["events_file"]) as f:
            text = f.read()
        check(platform_jwt not in text and "access_token\"" not in text.replace("access_token_sha256", ""),
              "authlib: events.jsonl holds fingerprints only")
    finally:
        fixture(AUTHLIB, "down", "--dir", d)

    # Strict: aud must be the token endpoint, grant assertions single-use.
    d2 = os.path.join(tmp, "authlib-strict")
    info = json.loads(fixture(AUTHLIB, "up", "--dir", d2, "--audience", "token-endpoint", "--grant-replay", "refuse"))
    try:
        te, issuer = info["token_endpoint"], info["issuer"]
        key = Key("EC", tmp, "al2-ec")
        fixture(AUTHLIB, "register-client-keys", "--dir", d2, "--client", "c", "--jwks-json", json.dumps(key.jwk()))
        st1 = post(te, {"grant_type": "client_credentials", "client_assertion_type": CAT,
                        "client_assertion": key.sign("ES256", claims("c", issuer))})[0]
        st2 = post(te, {"grant_type": "client_credentials", "client_assertion_type": CAT,
                        "client_assertion": key.sign("ES256", claims("c", te))})[0]
        check(st1 != 200 and st2 == 200, f"authlib --audience token-endpoint: aud = issuer {st1}, aud = token endpoint {st2}")
        path = os.path.join(tmp, "p2.jwt")
        fixture(AUTHLIB, "mint-platform-token", "--dir", d2, "--sub", "w", "--aud", te, "--lifetime", "300", "--out", path)
        with open(path) as f:
            jwt = f.read()
        st1 = post(te, {"grant_type": JWT_BEARER, "assertion": jwt})[0]
        st2, ans = post(te, {"grant_type": JWT_BEARER, "assertion": jwt})
        check(st1 == 200 and st2 == 400 and ans.get("error") == "invalid_grant",
              f"authlib --grant-replay refuse: a platform token is good once ({st1}, then {st2} {ans.get('error_description')})")
    finally:
        fixture(AUTHLIB, "down", "--dir", d2)


def main():
    if not authlib_server.in_venv():
        authlib_server.ensure_venv()
        os.execv(authlib_server.venv_python(), [authlib_server.venv_python(), os.path.abspath(__file__), *sys.argv[1:]])
    which = sys.argv[1:] or ["glewlwyd", "authlib"]
    with tempfile.TemporaryDirectory(prefix="assertion-check-") as tmp:
        for name in which:
            try:
                {"glewlwyd": glewlwyd, "authlib": authlib}[name](tmp)
            except Exception as e:     # a fixture that did not come up: one failure, not a traceback
                check(False, f"{name}: {type(e).__name__}: {e}")
    print(f"{len(FAILURES)} failure(s)" if FAILURES else "all checks passed")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
