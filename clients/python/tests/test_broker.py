"""The Python client against the real daemon and the development issuer (its protected
resource), both started here from the build directory in $TOKENBROKER_BIN (support.Stack).

No token is printed: failures name tokens by a short fingerprint.
"""

import http.server
import multiprocessing
import signal
import threading
import urllib.error
import urllib.parse
import urllib.request

import httpx
import pytest
import requests

import tokenbroker
from support import CountingBroker, Stack, fingerprint
from tokenbroker import Broker, BrokerAuth, HTTPXBrokerAuth, should_retry


@pytest.fixture
def stack():
    stack = Stack()
    yield stack
    stack.stop()


class AlwaysUnauthorized:
    """A resource that refuses every token with 401 invalid_token, counting requests (and the
    ones that carried a token); with `redirect_to`, it answers 302 to there instead."""

    def __init__(self, redirect_to=None):
        self.requests = 0
        self.with_token = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests += 1
                if self.headers.get("Authorization"):
                    outer.with_token += 1
                if redirect_to:
                    self.send_response(302)
                    self.send_header("Location", redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="x", error="invalid_token"')
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"

    def stop(self):
        self.server.shutdown()


def test_token_recover_status_and_errors(stack):
    broker = Broker(stack.socket)
    token = broker.token("api")
    assert token.token_type == "Bearer" and token.expires_at and token.generation == 1
    assert token.token not in repr(token), "the token in its repr"
    # A stale rejection: the current token back, no refresh.
    grants = stack.counters()["refresh_token"]
    assert broker.recover("api", "an-old-token").token == token.token
    assert stack.counters()["refresh_token"] == grants
    assert [s["name"] for s in broker.status()] == ["api"]
    with pytest.raises(tokenbroker.NoSuchSession):
        broker.token("nope")
    broker.call("Logout", {"session": "api"})
    with pytest.raises(tokenbroker.SignedOut) as raised:
        broker.token("api")
    assert raised.value.session == "api"


def test_token_with_a_minimum_validity(stack):
    """min_valid: the token if it stays valid that long (the dev issuer's live an hour), else
    LifetimeTooShort saying how long they live; bad values refused before asking."""
    broker = Broker(stack.socket)
    token = fingerprint(broker.token("api").token)   # (fingerprints: a failed assert prints no token)
    grants = stack.counters()["refresh_token"]
    same = [fingerprint(broker.token("api", min_valid=valid).token) for valid in (600, 59.5)]
    assert same == [token, token]
    with pytest.raises(tokenbroker.LifetimeTooShort) as raised:
        broker.token("api", min_valid=2 * 3600)
    assert raised.value.session == "api" and 3590 <= raised.value.lifetime <= 3600 and raised.value.min_valid == 7200
    assert stack.counters()["refresh_token"] == grants, "no refresh: the lifetime is known"
    for bad in (0, -1, 10**9, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            broker.token("api", min_valid=bad)
    for bad in ("10m", True, None.__class__):
        with pytest.raises(TypeError):
            broker.token("api", min_valid=bad)
    with pytest.raises(ValueError):
        broker.proof("api", "GET", "https://rs.example/", rejected="x", min_valid=60)


def test_the_default_socket_is_tokenbroker_socket_then_the_users_own_then_the_systems(tmp_path, monkeypatch):
    """$TOKENBROKER_SOCKET, else this user's broker when something listens on its socket (a stale
    file is nobody's), else the system's."""
    import socket as sockets
    from tokenbroker.client import DEFAULT_SOCKET, default_socket
    monkeypatch.delenv("TOKENBROKER_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "tokenbroker").mkdir()
    path = str(tmp_path / "tokenbroker" / "io.tokenbroker.Broker")
    assert default_socket() == DEFAULT_SOCKET
    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    assert default_socket() == path and Broker().path == path
    listener.close()
    assert default_socket() == DEFAULT_SOCKET, "a socket file nobody listens on"
    monkeypatch.setenv("TOKENBROKER_SOCKET", "/srv/other.sock")
    assert default_socket() == "/srv/other.sock"


def test_reconnects_after_a_broker_restart(stack):
    broker = Broker(stack.socket)
    first = broker.token("api")
    stack.restart()
    assert broker.token("api").token == first.token, "the restarted broker serves the stored token"


def test_watch_yields_the_current_token_then_new_ones(stack):
    broker = Broker(stack.socket)
    current = broker.token("api")
    events = broker.watch("api")
    first = next(events)
    assert first.event == "token" and first.token.token == current.token
    fresh = broker.call("Refresh", {"session": "api"})
    second = next(events)
    assert second.event == "token" and second.token.token != current.token and second.token_serial == fresh["tokenSerial"]
    broker.call("Logout", {"session": "api"})
    third = next(events)
    assert third.event == "signedOut"
    events.close()


@pytest.mark.parametrize("client", ["requests", "httpx"])
def test_a_401_invalid_token_costs_one_recover_and_one_retry(stack, client):
    broker = Broker(stack.socket)
    stale = broker.token("api").token
    stack.revoke(stale)
    before = stack.counters()
    if client == "requests":
        response = requests.get(stack.base + "/resource", auth=BrokerAuth(broker, "api"), timeout=10)
    else:
        response = httpx.get(stack.base + "/resource", auth=HTTPXBrokerAuth(broker, "api"), timeout=10)
    after = stack.counters()
    assert response.status_code == 200
    assert after["refresh_token"] - before["refresh_token"] == 1
    assert after["resource"] - before["resource"] == 2
    assert broker.token("api").token != stale, f"still {fingerprint(stale)}"


@pytest.mark.parametrize("client", ["requests", "httpx"])
def test_a_403_is_not_retried(stack, client):
    broker = Broker(stack.socket)
    before = stack.counters()
    url = stack.base + "/resource?scope=admin"
    if client == "requests":
        response = requests.get(url, auth=BrokerAuth(broker, "api"), timeout=10)
    else:
        response = httpx.get(url, auth=HTTPXBrokerAuth(broker, "api"), timeout=10)
    after = stack.counters()
    assert response.status_code == 403
    assert after["resource"] - before["resource"] == 1 and after["refresh_token"] == before["refresh_token"]


@pytest.mark.parametrize("client", ["requests", "httpx"])
def test_a_second_401_goes_back_to_the_caller(stack, client):
    broker = Broker(stack.socket)
    resource = AlwaysUnauthorized()
    try:
        before = stack.counters()
        if client == "requests":
            response = requests.get(resource.url, auth=BrokerAuth(broker, "api"), timeout=10)
        else:
            response = httpx.get(resource.url, auth=HTTPXBrokerAuth(broker, "api"), timeout=10)
        assert response.status_code == 401
        assert resource.requests == 2, "not exactly one retry"
        assert stack.counters()["refresh_token"] - before["refresh_token"] == 1
    finally:
        resource.stop()


@pytest.mark.parametrize("client", ["requests", "httpx"])
def test_a_streamed_body_is_not_retried(stack, client):
    broker = Broker(stack.socket)
    stack.revoke(broker.token("api").token)
    before = stack.counters()

    def chunks():
        yield b"part one, "
        yield b"part two"

    if client == "requests":
        response = requests.put(stack.base + "/resource", data=chunks(), auth=BrokerAuth(broker, "api"), timeout=10)
    else:
        response = httpx.put(stack.base + "/resource", content=chunks(), auth=HTTPXBrokerAuth(broker, "api"), timeout=10)
    after = stack.counters()
    assert response.status_code == 401
    assert after["resource"] - before["resource"] == 1 and after["refresh_token"] == before["refresh_token"]


def test_a_post_is_retried_only_with_an_idempotency_key():
    assert not should_retry(401, ['Bearer error="invalid_token"'], tokenbroker.auth.replayable("POST", {}, False))
    assert should_retry(401, ['Bearer error="invalid_token"'], tokenbroker.auth.replayable("POST", {"Idempotency-Key": "k"}, False))
    assert not should_retry(401, ['Bearer error="insufficient_scope"'], True)
    assert not should_retry(401, ['Bearer realm="a", error="invalid_request"'], True)
    assert should_retry(401, ['Basic realm="a"'], True)
    assert should_retry(401, ['Bearer realm="a"'], True)
    assert not should_retry(401, ['Bearer error="invalid_token"'], True, attempt=2)
    assert not should_retry(403, [], True)
    # A server that takes both schemes sends a bare DPoP challenge beside its verdict on the bearer token.
    assert not should_retry(401, ['Bearer error="insufficient_scope", DPoP algs="ES256"'], True)
    assert should_retry(401, ['Bearer error="invalid_token", DPoP algs="ES256"'], True)
    assert should_retry(401, ['DPoP error="invalid_token"'], True, scheme="DPoP")
    assert not should_retry(401, ['DPoP error="invalid_dpop_proof", Bearer realm="a"'], True, scheme="DPoP")


def _worker(socket_path, url, stale, results):
    broker = Broker(socket_path)
    # Every process sends the same revoked token first, as if each had read it before.
    response = requests.get(url, headers={"Authorization": "Bearer " + stale}, timeout=30)
    if response.status_code == 401:
        fresh = broker.recover("api", stale)
        response = requests.get(url, headers={"Authorization": fresh.authorization}, timeout=30)
        results.put((response.status_code, fingerprint(fresh.token)))
    else:
        results.put((response.status_code, "unexpected"))


def test_fifty_processes_share_one_refresh(stack):
    broker = Broker(stack.socket)
    stale = broker.token("api").token
    stack.revoke(stale)
    before = stack.counters()
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(stack.socket, stack.base + "/resource", stale, results)) for _ in range(50)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    after = stack.counters()
    assert all(status == 200 for status, _ in outcomes), outcomes
    assert len({fp for _, fp in outcomes}) == 1, "the processes got different tokens"
    assert after["refresh_token"] - before["refresh_token"] == 1
    assert after["replays"] == 0


@pytest.mark.parametrize("client", ["requests", "httpx"])
def test_a_401_after_a_redirect_to_another_origin_is_not_retried_and_gets_no_token(stack, client):
    broker = Broker(stack.socket)
    foreign = AlwaysUnauthorized()
    start = AlwaysUnauthorized(redirect_to=foreign.url)
    try:
        before = stack.counters()
        if client == "requests":
            response = requests.get(start.url, auth=BrokerAuth(broker, "api"), timeout=10)
        else:
            response = httpx.get(start.url, auth=HTTPXBrokerAuth(broker, "api"), follow_redirects=True, timeout=10)
        assert response.status_code == 401
        assert foreign.requests == 1 and foreign.with_token == 0, "the token went to another origin, or was retried there"
        assert stack.counters()["refresh_token"] == before["refresh_token"]
    finally:
        foreign.stop()
        start.stop()


def recover_calls(broker):
    """Recoveries a CountingBroker has asked for."""
    return broker.recoveries


class FrontResource:
    """A resource on loopback in front of the issuer's: each request's token is checked at the
    issuer's /resource and its answer passed on (200 for a live token, 401 invalid_token for a
    revoked one, a bare Bearer 401 without a token). `redirects` maps a path to (status,
    location, always): that redirect instead, for a live token only unless `always`.

    Every arrival goes into `log` (shared between servers, in order of arrival) as
    (server name, path, method, token fingerprint, Idempotency-Key, body length)."""

    def __init__(self, name, issuer, log, lock):
        self.redirects = {}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                authorization = self.headers.get("Authorization")
                token = authorization[len("Bearer "):] if authorization and authorization.startswith("Bearer ") else None
                path = urllib.parse.urlsplit(self.path).path
                with lock:
                    log.append((name, path, self.command, fingerprint(token), self.headers.get("Idempotency-Key"), len(body)))
                check = urllib.request.Request(issuer + "/resource", headers={"Authorization": authorization} if authorization else {})
                try:
                    with urllib.request.urlopen(check, timeout=10) as verdict:
                        status, challenge = verdict.status, None
                except urllib.error.HTTPError as error:
                    status, challenge = error.code, error.headers.get("WWW-Authenticate")
                    error.close()
                redirect = outer.redirects.get(path)
                if redirect and (status == 200 or redirect[2]):
                    self.send_response(redirect[0])
                    self.send_header("Location", redirect[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(status)
                if challenge:
                    self.send_header("WWW-Authenticate", challenge)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_PUT = do_POST = answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def _send(client, broker, method, url, body, headers):
    """One business request through the client's auth class, redirects followed."""
    if client == "requests":
        return requests.request(method, url, data=body, headers=headers, auth=BrokerAuth(broker, "api"), timeout=10)
    if client == "httpx":
        return httpx.request(method, url, content=body, headers=headers, auth=HTTPXBrokerAuth(broker, "api"),
                             follow_redirects=True, timeout=10)
    import asyncio

    async def send():
        async with httpx.AsyncClient(auth=HTTPXBrokerAuth(broker, "api"), follow_redirects=True, timeout=10) as http:
            return await http.request(method, url, content=body, headers=headers)

    return asyncio.run(send())


def _named(arrivals, names):
    """The log with fingerprints replaced by what they are (rejected, fresh, none)."""
    return [(server, path, method, names.get(token, token), key, length) for server, path, method, token, key, length in arrivals]


@pytest.mark.parametrize("client", ["requests", "httpx", "httpx-async"])
@pytest.mark.parametrize("origin", ["same-origin", "cross-origin"])
@pytest.mark.parametrize("status", [307, 302])
def test_a_redirect_answering_the_retry_costs_no_second_recover_or_retry(stack, client, origin, status):
    """401 invalid_token, then the retry (fresh token) is answered with a redirect: that redirect
    is followed with the fresh token (same origin) or with none (another origin), and nothing is
    recovered or retried again. 307 keeps a PUT with an Idempotency-Key; 302 a GET."""
    broker = CountingBroker(stack.socket)
    log, lock = [], threading.Lock()
    start = FrontResource("start", stack.base, log, lock)
    foreign = FrontResource("foreign", stack.base, log, lock) if origin == "cross-origin" else None
    try:
        target = (foreign or start).url + "/target"
        start.redirects["/start"] = (status, target, False)
        method, body, headers = ("PUT", b"the business body", {"Idempotency-Key": "k-307"}) if status == 307 else ("GET", None, {})
        rejected = broker.token("api").token
        stack.revoke(rejected)
        refreshes, recovers = stack.counters()["refresh_token"], recover_calls(broker)

        response = _send(client, broker, method, start.url + "/start", body, headers)

        fresh = broker.token("api").token
        names = {fingerprint(rejected): "rejected", fingerprint(fresh): "fresh", "-": "none"}
        arrivals = _named(log, names)
        recovered, refreshed = recover_calls(broker) - recovers, stack.counters()["refresh_token"] - refreshes
        figures = (f"{method} arrived {len(arrivals)} times, {recovered} Recover, {refreshed} refresh: {arrivals}")
        key, length = headers.get("Idempotency-Key"), len(body or b"")
        expected = [("start", "/start", method, "rejected", key, length), ("start", "/start", method, "fresh", key, length)]
        if origin == "same-origin":
            expected.append(("start", "/target", method, "fresh", key, length))
        else:
            expected.append(("foreign", "/target", method, "none", key, length))
        assert arrivals == expected, figures
        assert recovered == 1 and refreshed == 1, figures
        assert response.status_code == (200 if origin == "same-origin" else 401), figures
        assert fresh != rejected
    finally:
        start.stop()
        if foreign:
            foreign.stop()


@pytest.mark.parametrize("client", ["requests", "httpx", "httpx-async"])
def test_a_401_after_a_same_origin_redirect_costs_one_recover_and_one_retry(stack, client):
    """A 307 first (to the same origin, whatever the token), then the 401: one Recover, one
    retry, and the rejected token is not sent again once the fresh one has gone out."""
    broker = CountingBroker(stack.socket)
    log, lock = [], threading.Lock()
    start = FrontResource("start", stack.base, log, lock)
    try:
        start.redirects["/start"] = (307, start.url + "/target", True)
        rejected = broker.token("api").token
        stack.revoke(rejected)
        refreshes, recovers = stack.counters()["refresh_token"], recover_calls(broker)

        response = _send(client, broker, "PUT", start.url + "/start", b"body", {"Idempotency-Key": "k"})

        fresh = broker.token("api").token
        arrivals = _named(log, {fingerprint(rejected): "rejected", fingerprint(fresh): "fresh", "-": "none"})
        recovered, refreshed = recover_calls(broker) - recovers, stack.counters()["refresh_token"] - refreshes
        figures = f"PUT arrived {len(arrivals)} times, {recovered} Recover, {refreshed} refresh: {arrivals}"
        tokens = [token for _, _, _, token, _, _ in arrivals]
        assert response.status_code == 200, figures
        assert recovered == 1 and refreshed == 1, figures
        assert arrivals[:2] == [("start", "/start", "PUT", "rejected", "k", 4), ("start", "/target", "PUT", "rejected", "k", 4)], figures
        assert arrivals[-1] == ("start", "/target", "PUT", "fresh", "k", 4), figures
        assert "rejected" not in tokens[tokens.index("fresh"):], figures
        # requests retries the hop that was refused; httpx sends the business request again.
        assert len(arrivals) == (3 if client == "requests" else 4), figures
    finally:
        start.stop()


def test_requests_a_redirect_of_the_retry_followed_by_hand_carries_the_fresh_token(stack):
    """allow_redirects=False: the retry's 307 comes back with `next`, which the caller sends. It
    carries the fresh token, and a 401 to it is not recovered or retried again."""
    broker = CountingBroker(stack.socket)
    log, lock = [], threading.Lock()
    start = FrontResource("start", stack.base, log, lock)
    try:
        start.redirects["/start"] = (307, start.url + "/target", False)
        rejected = broker.token("api").token
        stack.revoke(rejected)
        recovers = recover_calls(broker)
        with requests.Session() as http:
            response = http.put(start.url + "/start", data=b"body", headers={"Idempotency-Key": "k"},
                                auth=BrokerAuth(broker, "api"), allow_redirects=False, timeout=10)
            assert response.status_code == 307 and response.next is not None
            followed = http.send(response.next, allow_redirects=False, timeout=10)
        fresh = broker.token("api").token
        arrivals = _named(log, {fingerprint(rejected): "rejected", fingerprint(fresh): "fresh", "-": "none"})
        figures = f"PUT arrived {len(arrivals)} times, {recover_calls(broker) - recovers} Recover: {arrivals}"
        assert followed.status_code == 200, figures
        assert [token for _, _, _, token, _, _ in arrivals] == ["rejected", "fresh", "fresh"], figures
        assert recover_calls(broker) - recovers == 1, figures
    finally:
        start.stop()


def test_httpx_async_client(stack):
    import asyncio
    broker = Broker(stack.socket)
    stack.revoke(broker.token("api").token)
    before = stack.counters()

    async def fetch():
        async with httpx.AsyncClient(auth=HTTPXBrokerAuth(broker, "api"), timeout=10) as client:
            return await client.get(stack.base + "/resource")

    assert asyncio.run(fetch()).status_code == 200
    assert stack.counters()["refresh_token"] - before["refresh_token"] == 1


def _child(broker, index, results):
    try:
        if index % 2:
            results.put(("status", [s["name"] for s in broker.status()]))
        else:
            results.put(("token", fingerprint(broker.token("api").token)))
    except Exception as error:  # noqa: BLE001 - reported to the parent
        results.put(("error", type(error).__name__))


def test_children_forked_after_a_call_do_not_share_its_connection(stack):
    broker = Broker(stack.socket)
    expected = fingerprint(broker.token("api").token)   # the parent's connection is open now
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    children = [context.Process(target=_child, args=(broker, index, results)) for index in range(20)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=30)
    assert sorted(outcomes) == sorted([("status", ["api"])] * 10 + [("token", expected)] * 10), outcomes
    assert broker.token("api").token, "the parent's own connection still works"


def test_a_call_interrupted_while_waiting_leaves_no_reply_behind():
    stack = Stack(slow=True)
    try:
        broker = Broker(stack.socket, timeout=10)
        broker.call("Login", {"session": "slow", "refreshToken": "not-a-real-one"})

        def interrupt(*_):
            raise KeyboardInterrupt()

        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            broker.call("Refresh", {"session": "slow"})   # its upstream never answers (3 s deadline)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        # The Refresh's own answer comes later: the next call must not read it as its own.
        assert sorted(s["name"] for s in broker.status()) == ["api", "slow"]
        assert broker.token("api").token
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        stack.stop()


def test_keys_narrow_the_token_in_every_call_and_auth():
    """A key (resource, scope) through token, recover, proof, credential and both auths: each the
    key's one token, exchanged once; a key the session does not allow is InvalidParameter."""
    k1 = "https://k1.example/"
    stack = Stack(keys=[k1], serves="https://git.example.test/")
    try:
        broker = Broker(stack.socket)
        before = stack.counters()
        plain = broker.token("api")
        narrowed = broker.token("api", resource=k1)
        scoped = broker.token("api", scope="read")
        assert len({fingerprint(plain.token), fingerprint(narrowed.token), fingerprint(scoped.token)}) == 3
        assert fingerprint(broker.token("api", resource=k1).token) == fingerprint(narrowed.token)
        assert fingerprint(broker.recover("api", "an-old-token", resource=k1).token) == fingerprint(narrowed.token)
        proven = broker.proof("api", "GET", stack.base + "/resource", resource=k1)
        assert proven.proof is None and fingerprint(proven.token.token) == fingerprint(narrowed.token)
        credential = broker.credential("https://git.example.test/org/repo.git", scope="read")
        assert credential.session == "api" and fingerprint(credential.token.token) == fingerprint(scoped.token)
        sent = []
        response = requests.get(stack.base + "/resource", auth=BrokerAuth(broker, "api", scope="read"), timeout=10)
        sent.append(response.request.headers["Authorization"])
        response = httpx.get(stack.base + "/resource", auth=HTTPXBrokerAuth(broker, "api", resource=k1), timeout=10)
        sent.append(response.request.headers["Authorization"])
        assert [fingerprint(s) for s in sent] == [fingerprint("Bearer " + scoped.token), fingerprint("Bearer " + narrowed.token)]
        assert stack.counters()["token_exchange"] - before["token_exchange"] == 2, "one exchange per key"
        with pytest.raises(tokenbroker.InvalidParameter):
            broker.token("api", resource="https://elsewhere.example/")
        with pytest.raises(tokenbroker.InvalidParameter):
            broker.token("api", scope="admin")
        with pytest.raises(TypeError):
            broker.token("api", resource=1)
    finally:
        stack.stop()
