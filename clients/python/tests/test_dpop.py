"""DPoP (RFC 9449) in the Python client: Broker.proof (GetProof), the `requests` and `httpx`
auth classes' proofs and their nonce and recovery retries, against the real daemon and the
development issuer (`--dpop accepted`, and `--dpop-nonces`), and against a resource server
written here whose proofs are checked by a library we did not write: pydpop (PyPI `pydpop`,
its `verify_proof`: the ES256 signature with the header's `jwk`, `typ` dpop+jwt, `htm`, `htu`,
`iat` within 60 s, `jti` unseen, `ath`; and its RFC 7638 `jwk_thumbprint`, compared here with
the token's `cnf.jkt`).

No token or proof is printed: failures name them by a short fingerprint.
"""

import asyncio
import base64
import hashlib
import http.server
import json
import threading
import time
import urllib.parse

import httpx
import keyring.credentials
import pydpop
import pytest
import requests

import tokenbroker
from support import CountingBroker, Stack, fingerprint
from tokenbroker import Broker, BrokerAuth, HTTPXBrokerAuth, decide_with_proof
from tokenbroker.keyring_backend import TokenBrokerKeyring

CLIENTS = ["requests", "httpx", "httpx-async"]


@pytest.fixture
def stack():
    """A bearer session (dev-issuer without DPoP)."""
    stack = Stack()
    yield stack
    stack.stop()


@pytest.fixture
def dpop_stack():
    """`api` with DPoP=yes, at a dev-issuer that takes proofs (`--dpop accepted`)."""
    stack = Stack(dpop="accepted")
    yield stack
    stack.stop()


@pytest.fixture
def nonce_stack():
    """As dpop_stack, with dev-issuer's token endpoint and resource demanding nonces."""
    stack = Stack(dpop="accepted", nonces=True)
    yield stack
    stack.stop()


def b64json(part):
    return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))


def jkt_of(token):
    """The `cnf.jkt` of one of dev-issuer's bound access tokens (a JWT; its signature is not
    checked: dev-issuer's are unsigned, and only the claim matters here)."""
    return b64json(token.split(".")[1])["cnf"]["jkt"]


def ath_of(token):
    return base64.urlsafe_b64encode(hashlib.sha256(token.encode()).digest()).rstrip(b"=").decode()


def send(client, auth, method, url, times=1, **options):
    """`times` requests through one client (a requests Session, an httpx Client or
    AsyncClient) with `auth`; their responses."""
    if client == "requests":
        with requests.Session() as http:
            return [http.request(method, url, auth=auth, timeout=10, **options) for _ in range(times)]
    if client == "httpx":
        with httpx.Client(auth=auth, timeout=10) as http:
            return [http.request(method, url, **options) for _ in range(times)]

    async def run():
        async with httpx.AsyncClient(auth=auth, timeout=10) as http:
            return [await http.request(method, url, **options) for _ in range(times)]

    return asyncio.run(run())


class ProofCheckingResource:
    """A resource server on loopback that takes only DPoP-bound tokens with a valid proof,
    checked with pydpop (see the module's documentation), and whose key's thumbprint is the
    token's `cnf.jkt`; a `jti` is taken once. With `nonce` set, a proof must carry it (401
    `use_dpop_nonce` and a `DPoP-Nonce` header otherwise; every answer names it). `script`:
    answers (status, WWW-Authenticate, DPoP-Nonce) given instead, in order, one per request.
    `redirects` maps a path to (status, location): that answer to a request whose proof is
    good.

    Every arrival goes into `log` as a dict: path, method, status, jti, why (refused),
    token (fingerprint), dpop (whether a DPoP header came), nonce (the proof's)."""

    def __init__(self):
        self.nonce = None
        self.script = []
        self.redirects = {}
        self.log = []
        self.lock = threading.Lock()
        self.seen = pydpop.MemoryJtiStore(ttl=120)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = urllib.parse.urlsplit(self.path).path
                entry = {"path": path, "method": self.command, "jti": None, "why": None, "nonce": None,
                         "dpop": "DPoP" in self.headers, "token": "-"}
                with outer.lock:
                    status, challenge, extra = outer.judge(self, path, entry)
                    entry["status"] = status
                    outer.log.append(entry)
                redirect = outer.redirects.get(path) if status == 200 else None
                self.send_response(redirect[0] if redirect else status)
                if redirect:
                    self.send_header("Location", redirect[1])
                if challenge:
                    self.send_header("WWW-Authenticate", challenge)
                nonce = extra if extra is not None else outer.nonce
                if nonce:
                    self.send_header("DPoP-Nonce", nonce)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_PUT = do_POST = do_DELETE = answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def judge(self, handler, path, entry):
        """(status, WWW-Authenticate, DPoP-Nonce or None) for one request."""
        authorization = handler.headers.get("Authorization") or ""
        scheme, _, token = authorization.partition(" ")
        entry["token"] = fingerprint(token)
        if self.script:
            proof = handler.headers.get("DPoP")
            entry["nonce"] = b64json(proof.split(".")[1]).get("nonce") if proof else None   # (not verified)
            return self.script.pop(0)
        if scheme != "DPoP" or not token:
            return 401, 'DPoP algs="ES256"', None
        proofs = handler.headers.get_all("DPoP") or []
        if len(proofs) != 1:
            entry["why"] = f"{len(proofs)} DPoP headers"
            return 401, 'DPoP error="invalid_dpop_proof"', None
        try:
            header = b64json(proofs[0].split(".")[0])
            if header.get("alg") != "ES256":
                raise pydpop.DPoPError("not ES256")
            verified = pydpop.verify_proof(proof=proofs[0], htm=handler.command, htu=self.url + path, access_token=token,
                                           clock_skew=60, jti_store=None)
            claims = verified["claims"]
            entry["jti"], entry["nonce"] = claims.get("jti"), claims.get("nonce")
            if verified["jwk_thumbprint"] != jkt_of(token):
                raise pydpop.DPoPError("the proof's key is not the token's (cnf.jkt)")
        except (pydpop.DPoPError, ValueError, KeyError, IndexError) as error:
            entry["why"] = str(error).split(":")[0]
            return 401, 'DPoP error="invalid_dpop_proof"', None
        if self.nonce is not None and claims.get("nonce") != self.nonce:
            entry["why"] = "nonce"
            return 401, 'DPoP error="use_dpop_nonce"', None
        if self.seen.seen(claims["jti"]):
            entry["why"] = "replayed jti"
            return 401, 'DPoP error="invalid_dpop_proof"', None
        self.seen.add(claims["jti"])
        return 200, None, None

    def entries(self):
        with self.lock:
            return [dict(entry) for entry in self.log]

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def resource():
    served = ProofCheckingResource()
    yield served
    served.stop()


def summary(entries):
    """The log without jtis and fingerprints, for messages."""
    return [(e["path"], e["method"], e["status"], e["why"], e["dpop"], e["nonce"] is not None) for e in entries]


def auth_for(client, broker):
    return BrokerAuth(broker, "api") if client == "requests" else HTTPXBrokerAuth(broker, "api")


# -- the independent verifier


def test_the_verifier_refuses_what_it_should(dpop_stack, resource):
    """pydpop is not taken on trust: a changed signature, method, URL or token, and a replay,
    are refused by the resource; only the untouched proof is taken, once."""
    broker = Broker(dpop_stack.socket)
    url = resource.url + "/checked"
    proven = broker.proof("api", "GET", url)
    head, payload, signature = proven.proof.split(".")
    flipped = signature[:10] + ("A" if signature[10] != "A" else "B") + signature[11:]
    token = proven.token.token
    attempts = [
        ("signature", "GET", url, {"Authorization": "DPoP " + token, "DPoP": f"{head}.{payload}.{flipped}"}),
        ("method", "PUT", url, proven.headers()),
        ("url", "GET", resource.url + "/elsewhere", proven.headers()),
        ("token", "GET", url, {"Authorization": "DPoP " + token[:-4] + "AAAA", "DPoP": proven.proof}),
        ("good", "GET", url, proven.headers()),
        ("replay", "GET", url, proven.headers()),
    ]
    statuses = {name: requests.request(method, target, headers=headers, timeout=10).status_code
                for name, method, target, headers in attempts}
    assert statuses == {"signature": 401, "method": 401, "url": 401, "token": 401, "good": 200, "replay": 401}, \
        (statuses, summary(resource.entries()))
    whys = [entry["why"] for entry in resource.entries()]
    assert whys[-1] == "replayed jti" and whys[-2] is None, whys


@pytest.mark.parametrize("client", CLIENTS)
def test_every_request_gets_its_own_proof_that_an_independent_verifier_takes(dpop_stack, resource, client):
    broker = Broker(dpop_stack.socket)
    count = 5
    responses = send(client, auth_for(client, broker), "GET", resource.url + "/items?page=2#top", times=count)
    entries = resource.entries()
    assert [r.status_code for r in responses] == [200] * count, summary(entries)
    jtis = [entry["jti"] for entry in entries]
    assert len(entries) == count and len(set(jtis)) == count and None not in jtis, summary(entries)
    # The token every request carried is the session's, bound to its key.
    current = broker.token("api")
    assert current.token_type == "DPoP"
    assert {entry["token"] for entry in entries} == {fingerprint(current.token)}


@pytest.mark.parametrize("client", CLIENTS)
def test_a_proof_per_method_and_url(dpop_stack, resource, client):
    """A PUT (with a body) and a DELETE to other paths: their proofs name them."""
    broker = Broker(dpop_stack.socket)
    auth = auth_for(client, broker)
    body = {"data": b"the body"} if client == "requests" else {"content": b"the body"}
    put = send(client, auth, "PUT", resource.url + "/a/b", **body)[0]
    delete = send(client, auth, "DELETE", resource.url + "/c")[0]
    assert (put.status_code, delete.status_code) == (200, 200), summary(resource.entries())


def test_a_proof_sent_twice_by_hand_is_refused_the_second_time(dpop_stack, resource):
    broker = Broker(dpop_stack.socket)
    proven = broker.proof("api", "GET", resource.url + "/once")
    first = requests.get(resource.url + "/once", headers=proven.headers(), timeout=10)
    second = requests.get(resource.url + "/once", headers=proven.headers(), timeout=10)
    assert (first.status_code, second.status_code) == (200, 401), summary(resource.entries())
    assert 'error="invalid_dpop_proof"' in second.headers["WWW-Authenticate"]
    assert resource.entries()[-1]["why"] == "replayed jti"


@pytest.mark.parametrize("client", CLIENTS)
def test_the_resources_nonce_costs_one_retry_then_is_remembered(dpop_stack, resource, client):
    """use_dpop_nonce: one retry with the nonce; the auth object's next request there carries it
    at once; after the server changes it, one retry again."""
    broker = Broker(dpop_stack.socket)
    resource.nonce = "nonce-one"
    auth = auth_for(client, broker)
    first = send(client, auth, "GET", resource.url + "/n")
    assert [r.status_code for r in first] == [200]
    assert [(e["status"], e["why"], e["nonce"]) for e in resource.entries()] == [(401, "nonce", None), (200, None, "nonce-one")]
    again = send(client, auth, "GET", resource.url + "/n", times=2)
    assert [r.status_code for r in again] == [200, 200]
    assert len(resource.entries()) == 4, summary(resource.entries())
    resource.nonce = "nonce-two"
    rotated = send(client, auth, "GET", resource.url + "/n")
    entries = resource.entries()[4:]
    assert [r.status_code for r in rotated] == [200]
    assert [(e["status"], e["why"], e["nonce"]) for e in entries] == [(401, "nonce", "nonce-one"), (200, None, "nonce-two")]


@pytest.mark.parametrize("client", CLIENTS)
def test_a_nonce_retry_and_a_recovery_at_most_three_sends(dpop_stack, resource, client):
    """use_dpop_nonce, then invalid_token, then invalid_token again: three sends (the nonce
    retry, then the recovery), the third one's 401 to the caller."""
    broker = Broker(dpop_stack.socket)
    stale = broker.token("api").token
    refreshes = dpop_stack.counters()["refresh_token"]
    resource.script = [(401, 'DPoP error="use_dpop_nonce"', "n1"), (401, 'DPoP error="invalid_token"', None),
                       (401, 'DPoP error="invalid_token"', None), (200, None, None)]
    response = send(client, auth_for(client, broker), "GET", resource.url + "/three")[0]
    entries = resource.entries()
    assert response.status_code == 401 and len(entries) == 3, summary(entries)
    # The recovery: GetProof with the token sent as rejected, which was current: one refresh.
    assert dpop_stack.counters()["refresh_token"] - refreshes == 1
    fresh = broker.token("api").token
    assert [e["token"] for e in entries] == [fingerprint(stale), fingerprint(stale), fingerprint(fresh)]
    assert fresh != stale


@pytest.mark.parametrize("client", CLIENTS)
def test_a_second_nonce_challenge_goes_back_to_the_caller(dpop_stack, resource, client):
    broker = Broker(dpop_stack.socket)
    resource.script = [(401, 'DPoP error="use_dpop_nonce"', "n1"), (401, 'DPoP error="use_dpop_nonce"', "n2"),
                       (200, None, None)]
    response = send(client, auth_for(client, broker), "GET", resource.url + "/twice")[0]
    assert response.status_code == 401 and len(resource.entries()) == 2, summary(resource.entries())


@pytest.mark.parametrize("client", CLIENTS)
def test_no_retry_for_the_nonce_sent_a_403_or_a_request_that_cannot_be_sent_again(dpop_stack, resource, client):
    broker = Broker(dpop_stack.socket)
    auth = auth_for(client, broker)
    body = {"data": b"x"} if client == "requests" else {"content": b"x"}
    cases = [
        # The same nonce the proof carried (none): nothing new to retry with.
        ([(401, 'DPoP error="use_dpop_nonce"', None)], "GET", {}),
        ([(403, 'DPoP error="insufficient_scope"', "n1")], "GET", {}),
        ([(401, 'DPoP error="invalid_dpop_proof"', None)], "GET", {}),
        # A POST without an Idempotency-Key is never sent twice.
        ([(401, 'DPoP error="use_dpop_nonce"', "n1")], "POST", body),
        ([(401, 'DPoP error="invalid_token"', None)], "POST", body),
    ]
    for script, method, options in cases:
        resource.script = list(script) + [(200, None, None)]
        before = len(resource.entries())
        response = send(client, auth, method, resource.url + "/no", **options)[0]
        assert response.status_code == script[0][0] and len(resource.entries()) - before == 1, (script, method)
    # With an Idempotency-Key, a POST is retried with the nonce (one other than "n1", which
    # the answers above named: the auth object's proofs carry it now).
    resource.script = [(401, 'DPoP error="use_dpop_nonce"', "n9"), (200, None, None)]
    response = send(client, auth, "POST", resource.url + "/key", headers={"Idempotency-Key": "k"}, **body)[0]
    assert response.status_code == 200, summary(resource.entries())
    assert [e["nonce"] for e in resource.entries()[-2:]] == ["n1", "n9"], summary(resource.entries())


def test_requests_a_redirect_gets_a_proof_for_its_next_hop_and_none_to_another_origin(dpop_stack, resource):
    broker = Broker(dpop_stack.socket)
    foreign = ProofCheckingResource()
    try:
        resource.redirects["/start"] = (307, "/target")
        resource.redirects["/get"] = (302, resource.url + "/got")
        resource.redirects["/away"] = (302, foreign.url + "/there")
        with requests.Session() as http:
            put = http.put(resource.url + "/start", data=b"body", headers={"Idempotency-Key": "k"},
                           auth=BrokerAuth(broker, "api"), timeout=10)
            post = http.post(resource.url + "/get", data=b"body", auth=BrokerAuth(broker, "api"), timeout=10)
            away = http.get(resource.url + "/away", auth=BrokerAuth(broker, "api"), timeout=10)
            by_hand = http.get(resource.url + "/get", auth=BrokerAuth(broker, "api"), allow_redirects=False, timeout=10)
            followed = http.send(by_hand.next, allow_redirects=False, timeout=10)
        entries = resource.entries()
        assert [(e["path"], e["method"], e["status"]) for e in entries] == [
            ("/start", "PUT", 200), ("/target", "PUT", 200),   # 307 keeps the method
            ("/get", "POST", 200), ("/got", "GET", 200),       # 302 makes it a GET
            ("/away", "GET", 200),
            ("/get", "GET", 200), ("/got", "GET", 200),        # the redirect followed by hand
        ], summary(entries)
        assert (put.status_code, post.status_code, followed.status_code) == (200, 200, 200)
        assert away.status_code == 401
        assert [(e["dpop"], e["token"]) for e in foreign.entries()] == [(False, "-")], "a proof or the token went to another origin"
    finally:
        foreign.stop()


def test_httpx_a_redirect_it_follows_is_not_retried_and_one_followed_by_hand_gets_its_proof(dpop_stack, resource):
    """httpx follows redirects outside the auth flow, with the first request's proof: the hop
    is refused (the proof names another URL) and handed back, with no recovery. Followed by
    hand with the auth, the hop gets a proof of its own."""
    broker = CountingBroker(dpop_stack.socket)
    resource.redirects["/start"] = (307, "/target")
    refreshes = dpop_stack.counters()["refresh_token"]
    auth = HTTPXBrokerAuth(broker, "api")
    with httpx.Client(auth=auth, timeout=10) as http:
        followed = http.get(resource.url + "/start", follow_redirects=True)
        assert followed.status_code == 401 and broker.recoveries == 0, summary(resource.entries())
        first = http.get(resource.url + "/start", follow_redirects=False)
        by_hand = http.send(first.next_request, auth=auth)
    entries = resource.entries()
    assert [(e["path"], e["status"], e["why"]) for e in entries] == [
        ("/start", 200, None), ("/target", 401, "htu mismatch"), ("/start", 200, None), ("/target", 200, None)]
    assert (first.status_code, by_hand.status_code) == (307, 200)
    assert dpop_stack.counters()["refresh_token"] == refreshes and broker.recoveries == 0


# -- against dev-issuer's resource


@pytest.mark.parametrize("client", CLIENTS)
def test_dev_issuers_resource_takes_the_bound_token_with_its_proof(dpop_stack, client):
    broker = Broker(dpop_stack.socket)
    before = dpop_stack.counters()
    responses = send(client, auth_for(client, broker), "GET", dpop_stack.base + "/resource", times=3)
    after = dpop_stack.counters()
    assert [r.status_code for r in responses] == [200] * 3
    assert after["resource"] - before["resource"] == 3 and after["dpop_refused"] == before["dpop_refused"]
    assert after["refresh_token"] == before["refresh_token"]
    # Sent as a Bearer token, the same bound token is refused (RFC 9449 §7.2).
    token = broker.token("api")
    assert token.token_type == "DPoP"
    refused = requests.get(dpop_stack.base + "/resource", headers={"Authorization": "Bearer " + token.token}, timeout=10)
    assert refused.status_code == 401


@pytest.mark.parametrize("client", CLIENTS)
def test_dev_issuers_nonce_costs_one_retry(nonce_stack, client):
    broker = Broker(nonce_stack.socket)
    before = nonce_stack.counters()
    response = send(client, auth_for(client, broker), "GET", nonce_stack.base + "/resource")[0]
    after = nonce_stack.counters()
    assert response.status_code == 200
    assert after["resource"] - before["resource"] == 2
    assert after["dpop_nonce_challenges"] - before["dpop_nonce_challenges"] == 1
    assert after["dpop_refused"] == before["dpop_refused"] and after["refresh_token"] == before["refresh_token"]


@pytest.mark.parametrize("client", CLIENTS)
def test_dev_issuers_nonce_then_a_revoked_token_three_sends_one_refresh(nonce_stack, client):
    broker = Broker(nonce_stack.socket)
    stale = broker.token("api").token
    nonce_stack.revoke(stale)
    before = nonce_stack.counters()
    response = send(client, auth_for(client, broker), "GET", nonce_stack.base + "/resource")[0]
    after = nonce_stack.counters()
    # The revoked token is found out only once the proof has the nonce: nonce retry, then the
    # recovery (one refresh, itself with the token endpoint's nonce), then 200.
    assert response.status_code == 200
    assert after["resource"] - before["resource"] == 3
    assert after["refresh_token"] - before["refresh_token"] == 1
    assert broker.token("api").token != stale, f"still {fingerprint(stale)}"


@pytest.mark.parametrize("client", CLIENTS)
def test_dev_issuers_resource_a_revoked_token_is_recovered_once(dpop_stack, client):
    broker = Broker(dpop_stack.socket)
    stale = broker.token("api").token
    dpop_stack.revoke(stale)
    before = dpop_stack.counters()
    response = send(client, auth_for(client, broker), "GET", dpop_stack.base + "/resource")[0]
    after = dpop_stack.counters()
    assert response.status_code == 200
    assert after["resource"] - before["resource"] == 2 and after["refresh_token"] - before["refresh_token"] == 1


# -- Broker.proof


def test_proof_for_a_dpop_session(dpop_stack):
    broker = Broker(dpop_stack.socket)
    url = "https://API.example.test:8443/v1/items?secret=query#fragment"
    proven = broker.proof("api", "POST", url, nonce="server-nonce")
    token = proven.token.token
    assert proven.token.token_type == "DPoP" and proven.proof and proven.token.generation == 1
    headers = proven.headers()
    assert set(headers) == {"Authorization", "DPoP"} and headers["Authorization"] == "DPoP " + token
    leaked = any(secret in text for secret in (token, proven.proof) for text in (repr(proven), str(proven)))
    assert not leaked, "the token or the proof in the repr"
    verified = pydpop.verify_proof(proof=proven.proof, htm="POST", htu="https://api.example.test:8443/v1/items",
                                   access_token=token, expected_nonce="server-nonce", clock_skew=60)
    claims = verified["claims"]
    assert claims["htu"] == "https://api.example.test:8443/v1/items", "the query or fragment in htu"
    assert claims["ath"] == ath_of(token) and abs(claims["iat"] - time.time()) < 60
    assert verified["jwk_thumbprint"] == jkt_of(token)
    assert "d" not in b64json(proven.proof.split(".")[0])["jwk"]
    other = broker.proof("api", "POST", url)
    assert b64json(other.proof.split(".")[1])["jti"] != claims["jti"] and "nonce" not in b64json(other.proof.split(".")[1])
    assert other.token.token == token


def test_proof_for_a_bearer_session_has_no_proof(stack):
    broker = Broker(stack.socket)
    proven = broker.proof("api", "GET", stack.base + "/resource")
    current = broker.token("api")
    assert proven.proof is None and proven.token.token_type == "Bearer"
    assert fingerprint(proven.token.token) == fingerprint(current.token)
    assert proven.headers() == {"Authorization": current.authorization}
    assert current.token not in repr(proven)
    # The auth classes send a bearer session's token as before: no DPoP header.
    assert requests.get(stack.base + "/resource", auth=BrokerAuth(broker, "api"), timeout=10).status_code == 200
    assert httpx.get(stack.base + "/resource", auth=HTTPXBrokerAuth(broker, "api"), timeout=10).status_code == 200


def test_bearer_session_requests_send_no_dpop_header(stack):
    broker = Broker(stack.socket)
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            seen.append((self.command, "DPoP" in self.headers, (self.headers.get("Authorization") or "").split(" ")[0]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = answer

        def log_message(self, *args):
            pass

    setattr(Handler, "do_M-SEARCH", Handler.answer)   # a method GetProof does not take
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        for method in ("GET", "M-SEARCH"):
            assert requests.request(method, url, auth=BrokerAuth(broker, "api"), timeout=10).status_code == 200
            assert httpx.request(method, url, auth=HTTPXBrokerAuth(broker, "api"), timeout=10).status_code == 200
        assert seen == [("GET", False, "Bearer")] * 2 + [("M-SEARCH", False, "Bearer")] * 2
    finally:
        server.shutdown()
        server.server_close()


def test_a_dpop_session_refuses_a_request_getproof_cannot_name(dpop_stack):
    broker = Broker(dpop_stack.socket)
    with pytest.raises(ValueError):
        requests.request("M-SEARCH", "http://127.0.0.1:1/", auth=BrokerAuth(broker, "api"), timeout=10)
    with pytest.raises(ValueError):
        httpx.request("M-SEARCH", "http://127.0.0.1:1/", auth=HTTPXBrokerAuth(broker, "api"), timeout=10)


def test_proof_refuses_a_bad_method_url_or_nonce(stack, dpop_stack):
    for broker in (Broker(stack.socket), Broker(dpop_stack.socket)):
        for method, url, nonce in [("get", "http://h/", None), ("", "http://h/", None), ("G" * 17, "http://h/", None),
                                   ("M-SEARCH", "http://h/", None), ("GET", "ftp://h/", None), ("GET", "http://", None),
                                   ("GET", "/relative", None), ("GET", "http://h/" + "p" * 4096, None),
                                   ("GET", "http://h/a b", None), ("GET", "http://h/é", None),
                                   ("GET", "http://h/", 'a"b'), ("GET", "http://h/", "a\\b"), ("GET", "http://h/", ""),
                                   ("GET", "http://h/", "n" * 513)]:
            with pytest.raises(ValueError) as raised:
                broker.proof("api", method, url, nonce=nonce)
            assert "p" * 100 not in str(raised.value), "the URL in the message"
        with pytest.raises(TypeError):
            broker.proof("api", b"GET", "http://h/")
        with pytest.raises(ValueError):
            broker.proof("api", "GET", "http://h/", rejected="")
        # A long query is not sent (htu has none), so it does not count.
        assert broker.proof("api", "GET", "http://h/?" + "q" * 5000).token.token
        # What the broker itself refuses: InvalidParameter, a ValueError naming the parameter.
        for parameters, name in [({"method": "get", "uri": "http://h/"}, "method"),
                                 ({"method": "GET", "uri": "ftp://h/"}, "uri"),
                                 ({"method": "GET", "uri": "http://h/", "nonce": 'a"b'}, "nonce")]:
            with pytest.raises(tokenbroker.InvalidParameter) as refused:
                broker.call("GetProof", {"session": "api", **parameters})
            assert isinstance(refused.value, ValueError) and refused.value.parameter == name
            assert name in str(refused.value)
        assert broker.token("api").token, "the connection still serves"


def test_decide_with_proof():
    nonce = 'DPoP error="use_dpop_nonce"'
    assert decide_with_proof(401, [nonce], "n1", None, False, False, True) == ("nonce", "n1")
    assert decide_with_proof(401, [nonce], "n1", "n1", False, False, True).action == "deliver"   # the nonce sent
    assert decide_with_proof(401, [nonce], "n2", "n1", True, False, True).action == "deliver"    # had its nonce retry
    assert decide_with_proof(401, [nonce], None, None, False, False, True).action == "deliver"   # no DPoP-Nonce
    assert decide_with_proof(401, [nonce], 'a"b', None, False, False, True).action == "deliver"  # one GetProof won't take
    assert decide_with_proof(401, [nonce], "n1", None, False, True, True) == ("nonce", "n1")      # after a recovery too
    assert decide_with_proof(401, [nonce], "n1", None, False, False, False).action == "deliver"  # not replayable
    assert decide_with_proof(401, ['DPoP error="invalid_token"'], None, None, True, False, True).action == "recover"
    assert decide_with_proof(401, ['DPoP error="invalid_token"'], None, None, False, True, True).action == "deliver"
    assert decide_with_proof(401, ['DPoP algs="ES256"'], None, None, False, False, True).action == "recover"
    assert decide_with_proof(401, ['DPoP error="invalid_dpop_proof"'], None, None, False, False, True).action == "deliver"
    assert decide_with_proof(401, ['Bearer error="invalid_token", DPoP algs="ES256"'], None, None, False, False,
                             True).action == "recover"
    assert decide_with_proof(403, ['DPoP error="use_dpop_nonce"'], "n1", None, False, False, True).action == "deliver"
    assert tokenbroker.should_retry(401, ['DPoP error="invalid_token"'], True, scheme="DPoP")
    assert not tokenbroker.should_retry(401, ['DPoP error="invalid_dpop_proof"'], True, scheme="DPoP")
    # A request sent with a proof reads DPoP challenges only, one sent as Bearer Bearer ones only.
    assert decide_with_proof(401, ['DPoP error="invalid_dpop_proof", Bearer error="invalid_token"'], None, None, False, False,
                             True).action == "deliver"
    assert decide_with_proof(401, ['Bearer error="insufficient_scope", DPoP algs="ES256"'], None, None, False, False,
                             True, "Bearer").action == "deliver"


# -- the keyring backend


def test_keyring_does_not_hand_out_a_dpop_sessions_token():
    stack = Stack(dpop="accepted", serves="http://127.0.0.1:9/")
    try:
        broker = Broker(stack.socket)
        answer = broker.credential("http://127.0.0.1:9/simple/")
        assert answer.session == "api" and answer.token.token_type == "DPoP"   # served, but bound
        backend = TokenBrokerKeyring(broker)
        nothing = (backend.get_password("http://127.0.0.1:9/simple/", "oauth2") is None
                   and backend.get_credential("http://127.0.0.1:9/simple/", None) is None)
        assert nothing, "a DPoP-bound token handed out as a password"
        assert not isinstance(backend.get_credential("127.0.0.1:9", None), keyring.credentials.SimpleCredential)
    finally:
        stack.stop()
