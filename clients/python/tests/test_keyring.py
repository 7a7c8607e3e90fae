"""Broker.credential and the keyring backend against the real daemon (from $TOKENBROKER_BIN),
and real pip: `pip download` from a loopback PEP 503 index that accepts only the session's
current token as the Basic password, in a venv made here with keyring and this package.

No token is printed: failures name tokens by a short fingerprint, and pip's output is shown
with the token replaced by its fingerprint.
"""

import base64
import hashlib
import hmac
import http.server
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zipfile

import keyring
import keyring.backend
import keyring.backends.chainer
import keyring.core
import keyring.errors
import pytest

import tokenbroker
from support import eventually, fingerprint
from tokenbroker import Broker
from tokenbroker.keyring_backend import TokenBrokerKeyring

BIN = os.environ.get("TOKENBROKER_BIN", "")
CLIENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND = "tokenbroker.keyring_backend.TokenBrokerKeyring"
WHEEL = "tbdemo-0.1-py3-none-any.whl"


def build_wheel():
    """A minimal pure wheel of tbdemo 0.1 (METADATA, WHEEL, RECORD), as bytes."""
    files = {
        "tbdemo/__init__.py": b'__version__ = "0.1"\n',
        "tbdemo-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tbdemo\nVersion: 0.1\nSummary: tokenbroker's test package\n",
        "tbdemo-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tokenbroker-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tbdemo-0.1.dist-info/RECORD,,")
    files["tbdemo-0.1.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


class Index:
    """A PEP 503 simple index on loopback serving one wheel, every page and file only to HTTP
    Basic auth whose password is `expected()` (else 401 with a Basic challenge). Each request
    goes into `log` as (path, username, password fingerprint, status)."""

    def __init__(self, wheel):
        self.expected = lambda: None
        self.log = []
        self.lock = threading.Lock()
        digest = hashlib.sha256(wheel).hexdigest()
        pages = {
            "/simple/": b'<!DOCTYPE html><html><body><a href="tbdemo/">tbdemo</a></body></html>',
            "/simple/tbdemo/": f'<!DOCTYPE html><html><body><a href="../../files/{WHEEL}#sha256={digest}">{WHEEL}</a>'
                               "</body></html>".encode(),
        }
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                username, password = None, None
                authorization = self.headers.get("Authorization") or ""
                if authorization.startswith("Basic "):
                    try:
                        username, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
                    except ValueError:
                        pass
                expected = outer.expected()
                allowed = password is not None and expected is not None and hmac.compare_digest(password.encode(), expected.encode())
                path = self.path.split("?", 1)[0]
                if not allowed:
                    status, body, kind = 401, b"", "text/plain"
                elif path in pages:
                    status, body, kind = 200, pages[path], "text/html"
                elif path == "/files/" + WHEEL:
                    status, body, kind = 200, wheel, "application/octet-stream"
                else:
                    status, body, kind = 404, b"", "text/plain"
                with outer.lock:
                    outer.log.append((path, username, fingerprint(password), status))
                self.send_response(status)
                if status == 401:
                    self.send_header("WWW-Authenticate", 'Basic realm="tbdemo"')
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_HEAD = do_GET

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def entries(self):
        with self.lock:
            return list(self.log)

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


class Daemon:
    """tokenbroker serve with `Upstream=test` sessions: `index` serves the index's whole host
    and port, `other` a deeper path of it."""

    def __init__(self, port, sessions=None):
        if not BIN or not os.path.exists(os.path.join(BIN, "tokenbroker")):
            pytest.skip("TOKENBROKER_BIN does not hold a build (run through make python-test)")
        self.directory = tempfile.mkdtemp(prefix="tb-keyring-")
        self.config = os.path.join(self.directory, "tokenbroker.conf")
        if sessions is None:
            sessions = {"index": f"http://127.0.0.1:{port}/", "other": f"http://127.0.0.1:{port}/simple/other"}
        with open(self.config, "w") as f:
            f.write("[Broker]\nSocketMode=0600\n\n" + "".join(f"[Session]\nName={name}\nUpstream=test\nServes={serves}\n\n"
                                                             for name, serves in sessions.items()))
        self.socket = os.path.join(self.directory, "broker.sock")
        self.process = subprocess.Popen([os.path.join(BIN, "tokenbroker"), "serve", "--config", self.config, "--socket", self.socket,
                                         "--state-dir", self.directory + "/state"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually("the broker's socket", lambda: os.path.exists(self.socket) or self.process.poll() is not None)
        assert self.process.poll() is None, f"the daemon exited with {self.process.returncode}"

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def wheel():
    return build_wheel()


@pytest.fixture(scope="module")
def index(wheel):
    served = Index(wheel)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def daemon(index):
    running = Daemon(index.port)
    broker = Broker(running.socket)
    index.expected = lambda: broker.token("index").token   # the session's current token, asked each time
    yield running
    index.expected = lambda: None
    running.stop()


@pytest.fixture
def broker(daemon):
    with Broker(daemon.socket) as client:
        yield client


@pytest.fixture
def backend(broker):
    return TokenBrokerKeyring(broker)


def stale_rejections(broker, session):
    return next(s["staleRejections"] for s in broker.status() if s["name"] == session)


# -- Broker.credential


def test_credential_answers_with_the_session_that_serves_the_url(broker, index):
    current = fingerprint(broker.token("index").token)
    answer = broker.credential(index.url)
    got = fingerprint(answer.token.token)   # (fingerprints in locals: a failed assert shows no token)
    assert answer.session == "index" and got == current
    assert answer.token.token_type == "Bearer" and answer.token.expires_at and answer.token.generation >= 1
    leaked = answer.token.token in repr(answer)
    assert not leaked, "the token in Credential's repr"
    # pip asks with the index URL, then with its host:port, which may be either scheme: nobody
    # serves a URL without one (a token for an https entry must not reach a plain-http index).
    with pytest.raises(tokenbroker.NotServed):
        broker.credential(f"127.0.0.1:{index.port}")
    # The most specific entry wins.
    deeper = broker.credential(f"http://127.0.0.1:{index.port}/simple/other/x")
    got, other = fingerprint(deeper.token.token), fingerprint(broker.token("other").token)
    assert deeper.session == "other" and got == other


def test_credential_with_a_stale_rejection_answers_the_current_token_as_recover_does(broker, index):
    current = fingerprint(broker.token("index").token)
    before = stale_rejections(broker, "index")
    answer = broker.credential(index.url, rejected="an-old-token")
    got = fingerprint(answer.token.token)
    assert answer.session == "index" and got == current
    assert stale_rejections(broker, "index") == before + 1


def test_a_url_nobody_serves_is_not_served(broker, index):
    for url in ("http://127.0.0.1:1/simple/", f"https://127.0.0.1:{index.port}/simple/",
                "127.0.0.1", "http://elsewhere.test/", "not a url"):
        with pytest.raises(tokenbroker.NotServed) as raised:
            broker.credential(url)
        assert isinstance(raised.value, tokenbroker.NoSuchSession) and raised.value.session == ""
        assert url not in str(raised.value) and "serves" in str(raised.value)
    assert broker.token("index").token, "the connection still serves"


def test_credential_refuses_what_is_not_a_url_before_asking(broker):
    for url in (None, b"http://127.0.0.1/", 5):
        with pytest.raises(TypeError):
            broker.credential(url)
    with pytest.raises(TypeError):
        broker.credential("http://127.0.0.1/", rejected=b"old")
    for url in ("", "h" * 2049, "é" * 1025):
        with pytest.raises(ValueError):
            broker.credential(url)
    with pytest.raises(tokenbroker.NotServed):
        broker.credential("h" * 2048)   # the longest the contract takes is asked


# -- the keyring backend, in this process


def test_get_password_and_get_credential(backend, broker, index, monkeypatch):
    current = fingerprint(broker.token("index").token)
    monkeypatch.delenv("TOKENBROKER_KEYRING_USERNAME", raising=False)
    got = fingerprint(backend.get_password(index.url, "anyone"))
    assert got == current
    # A bare host:port (pip's second question) may be either scheme: nobody's.
    assert backend.get_password(f"127.0.0.1:{index.port}", None) is None
    credential = backend.get_credential(index.url, None)
    assert isinstance(credential, keyring.credentials.SimpleCredential)
    got = fingerprint(credential.password)
    assert credential.username == "oauth2" and got == current
    assert backend.get_credential(index.url, "__token__").username == "__token__"
    monkeypatch.setenv("TOKENBROKER_KEYRING_USERNAME", "x-access-token")
    assert backend.get_credential(index.url, None).username == "x-access-token"
    assert backend.get_credential(index.url, "me").username == "me"


def test_a_url_nobody_serves_is_none(backend, index):
    unserved = index.url.replace("http:", "https:")
    # (Booleans in locals: a failed assert shows no token.)
    nothing = backend.get_password(unserved, "oauth2") is None and backend.get_credential(unserved, None) is None
    assert nothing
    nothing = backend.get_password("127.0.0.1", "oauth2") is None
    assert nothing


def test_bad_inputs_are_served_by_nobody_or_refused(backend):
    for service in ("", "x" * 2049, "h" * 100_000, "a b", "http://127.0.0.1:1/\n", "\0", "http://[::1"):
        nothing = backend.get_password(service, "oauth2") is None and backend.get_credential(service, None) is None
        assert nothing, repr(service[:20])
    for service in (None, b"127.0.0.1", 1):
        with pytest.raises(TypeError):
            backend.get_password(service, "oauth2")


def test_set_and_delete_are_refused(backend, index):
    with pytest.raises(keyring.errors.PasswordSetError) as raised:
        backend.set_password(index.url, "oauth2", "a-password")
    assert isinstance(raised.value, NotImplementedError), "keyring's chainer passes on only NotImplementedError"
    assert "a-password" not in str(raised.value)
    with pytest.raises(keyring.errors.PasswordDeleteError) as deleted:
        backend.delete_password(index.url, "oauth2")
    assert isinstance(deleted.value, NotImplementedError)


def test_a_broker_that_cannot_be_reached_is_a_keyring_error(tmp_path, index):
    backend = TokenBrokerKeyring(Broker(str(tmp_path / "no-broker.sock"), timeout=5))
    with pytest.raises(keyring.errors.KeyringError) as raised:
        backend.get_password(index.url, "oauth2")
    assert "tokenbroker" in str(raised.value) and index.url not in str(raised.value)


def test_priority_explicit_selection_and_entry_point(monkeypatch, daemon, broker, index):
    monkeypatch.delenv("TOKENBROKER_SOCKET", raising=False)
    assert TokenBrokerKeyring.priority < 0 and TokenBrokerKeyring().priority < 0, "auto-selected without TOKENBROKER_SOCKET"
    # Selected by name, it loads all the same (keyring reads the priority to check it).
    assert isinstance(keyring.core.load_keyring(BACKEND), TokenBrokerKeyring)
    monkeypatch.setenv("TOKENBROKER_SOCKET", daemon.socket)
    assert TokenBrokerKeyring.priority == 9
    # keyring finds the backend (its entry point, or this module being loaded) and, with the
    # socket set, picks it or asks it first in its chainer.
    monkeypatch.delenv("PYTHON_KEYRING_BACKEND", raising=False)
    previous = keyring.get_keyring()
    try:
        monkeypatch.setattr(keyring.core, "load_config", lambda: None)
        keyring.core.init_backend()
        chosen = keyring.get_keyring()
        first = chosen.backends[0] if isinstance(chosen, keyring.backends.chainer.ChainerBackend) else chosen
        assert isinstance(first, TokenBrokerKeyring), str(chosen)
        got, current = fingerprint(keyring.get_password(index.url, "oauth2")), fingerprint(broker.token("index").token)
        assert got == current
    finally:
        keyring.set_keyring(previous)


# -- real pip, in a venv of its own


NETWORK_TROUBLE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
                   "No matching distribution found", "Could not find a version", "ConnectTimeoutError", "ProxyError")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A venv with pip, keyring and this package (its [keyring] extra) installed from PyPI
    (cached wheels when pip has them)."""
    directory = tmp_path_factory.mktemp("pip-venv")
    subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    python = str(directory / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{CLIENT}[keyring]"],
                             env=pip_environment(), capture_output=True, text=True, timeout=240)
    if install.returncode != 0:
        output = install.stdout + install.stderr
        if any(sign in output for sign in NETWORK_TROUBLE):
            pytest.skip(f"the package index is unreachable, so keyring cannot be installed: {output[-400:]}")
        raise AssertionError(f"pip install failed: {output[-2000:]}")
    return directory


def pip_environment(**settings):
    """This environment without pip's, keyring's or tokenbroker's settings (and no pip
    configuration file), plus `settings`."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith(("PIP_", "PYTHON_KEYRING", "TOKENBROKER_", "KEYRING_"))}
    environment.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    environment.update(settings)
    return environment


def run_pip_download(venv, url, destination, environment, provider_option=True):
    """pip download of tbdemo from `url` with keyring imported (the option, else
    PIP_KEYRING_PROVIDER=import)."""
    provider = ["--keyring-provider", "import"] if provider_option else []
    if not provider_option:
        environment = dict(environment, PIP_KEYRING_PROVIDER="import")
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                           "--index-url", url, *provider, "tbdemo", "-d", str(destination)],
                          env=environment, capture_output=True, text=True, timeout=60)


def shown(output, *secrets):
    """pip's output with the tokens replaced by their fingerprints."""
    for secret in secrets:
        output = output.replace(secret, f"<token {fingerprint(secret)}>")
    return output[-3000:]


@pytest.mark.parametrize("selection", ["PYTHON_KEYRING_BACKEND", "entry point"])
def test_pip_downloads_from_an_index_that_requires_the_token(venv, daemon, broker, index, wheel, tmp_path, selection):
    """The backend named (with pip's --keyring-provider import), or found by keyring through the
    entry point with only TOKENBROKER_SOCKET set (with PIP_KEYRING_PROVIDER=import)."""
    current = broker.token("index").token
    settings = {"TOKENBROKER_SOCKET": daemon.socket}
    if selection == "PYTHON_KEYRING_BACKEND":
        settings["PYTHON_KEYRING_BACKEND"] = BACKEND
    index.log.clear()
    done = run_pip_download(venv, index.url, tmp_path, pip_environment(**settings), provider_option=selection == "PYTHON_KEYRING_BACKEND")
    log = index.entries()
    figures = f"pip exited {done.returncode}; the index saw {log}; pip said: {shown(done.stdout + done.stderr, current)}"
    assert done.returncode == 0, figures
    with open(tmp_path / WHEEL, "rb") as f:
        assert f.read() == wheel, figures
    # pip asks without credentials first (401), then sends the token with the username keyring gave.
    authenticated = [entry for entry in log if entry[1] is not None]
    assert log[0][1:] == (None, "-", 401) and [entry for entry in log if entry[3] == 401] == log[:1], figures
    assert {path for path, _, _, status in authenticated if status == 200} >= {"/simple/tbdemo/", "/files/" + WHEEL}, figures
    expected = fingerprint(current)
    assert all(user == "oauth2" and password == expected and status == 200 for _, user, password, status in authenticated), figures


def test_pip_gets_no_token_for_an_index_nobody_serves(venv, daemon, broker, wheel, tmp_path):
    unserved = Index(wheel)   # another port: the session serves only the first index's
    try:
        current = broker.token("index").token
        unserved.expected = lambda: current   # it would take the token, but nobody serves it
        nothing = TokenBrokerKeyring(broker).get_password(unserved.url, "oauth2") is None
        assert nothing
        environment = pip_environment(TOKENBROKER_SOCKET=daemon.socket, PYTHON_KEYRING_BACKEND=BACKEND)
        done = run_pip_download(venv, unserved.url, tmp_path, environment)
        log = unserved.entries()
        figures = f"pip exited {done.returncode}; the index saw {log}; pip said: {shown(done.stdout + done.stderr, current)}"
        assert done.returncode != 0 and not os.path.exists(tmp_path / WHEEL), figures
        # Refused without credentials, and never asked again with any.
        assert log and all(entry[1:] == (None, "-", 401) for entry in log), figures
    finally:
        unserved.stop()


def test_pip_sends_no_token_for_an_https_entry_to_a_plain_http_index(venv, wheel, tmp_path):
    """`Serves=127.0.0.1:PORT` means https; pip, refused by the index's URL (http), asks keyring
    again with the bare host:port (issue 32: it then sent the token in clear)."""
    plain = Index(wheel)
    daemon = Daemon(plain.port, sessions={"index": f"127.0.0.1:{plain.port}"})
    try:
        with Broker(daemon.socket) as client:
            current = client.token("index").token
        plain.expected = lambda: current   # the index would take it
        environment = pip_environment(TOKENBROKER_SOCKET=daemon.socket, PYTHON_KEYRING_BACKEND=BACKEND)
        done = run_pip_download(venv, plain.url, tmp_path, environment)
        log = plain.entries()
        figures = f"pip exited {done.returncode}; the index saw {log}; pip said: {shown(done.stdout + done.stderr, current)}"
        assert done.returncode != 0 and not os.path.exists(tmp_path / WHEEL), figures
        leaked = [entry for entry in log if entry[2] == fingerprint(current)]
        assert log and not leaked and all(entry[1:] == (None, "-", 401) for entry in log), figures
    finally:
        daemon.stop()
        plain.stop()


def test_pip_goes_on_without_keyring_when_the_broker_cannot_be_reached(venv, index, tmp_path):
    environment = pip_environment(TOKENBROKER_SOCKET=str(tmp_path / "no-broker.sock"), PYTHON_KEYRING_BACKEND=BACKEND)
    index.log.clear()
    done = run_pip_download(venv, index.url, tmp_path / "downloads", environment)
    log = index.entries()
    figures = f"pip exited {done.returncode}; the index saw {log}; pip said: {done.stdout + done.stderr}"
    assert done.returncode != 0 and log and all(entry[1:] == (None, "-", 401) for entry in log), figures
    assert "tokenbroker: cannot connect" in done.stderr, figures


def test_the_keyring_command_answers_for_the_url(venv, daemon, broker, index):
    """The keyring CLI (what `--keyring-provider subprocess` and uv run) in the venv."""
    current = broker.token("index").token
    environment = pip_environment(TOKENBROKER_SOCKET=daemon.socket, PYTHON_KEYRING_BACKEND=BACKEND)
    command = str(venv / "bin" / "keyring")
    got = subprocess.run([command, "get", index.url, "oauth2"], env=environment, capture_output=True, text=True, timeout=30)
    answered = got.returncode == 0 and got.stdout == current + "\n"
    assert answered, f"{got.returncode} {shown(got.stdout + got.stderr, current)}"
    missing = subprocess.run([command, "get", index.url.replace("http:", "https:"), "oauth2"], env=environment,
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1 and missing.stdout == "", shown(missing.stdout + missing.stderr, current)
    refused = subprocess.run([command, "set", index.url, "oauth2"], input="a-password\n", env=environment,
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "stores no passwords" in refused.stderr + refused.stdout, shown(refused.stderr, current)


# -- URL readings: what the broker serves for a URL, every common reader of it reaches


SERVED = {"scoped": ("https", "good.test", None, "/org"), "plain": ("http", "127.0.0.1", 8080, "/api"),
          "bare": ("https", "bare.test", 8443, "")}


@pytest.fixture(scope="module")
def readings_daemon():
    running = Daemon(0, sessions={"scoped": "https://good.test/org", "plain": "http://127.0.0.1:8080/api", "bare": "bare.test:8443"})
    yield running
    running.stop()


def curl_reading(url):
    """libcurl's reading (its URL API, through ctypes): (scheme, host, port, path), or None."""
    import ctypes
    import ctypes.util
    curl = ctypes.CDLL(ctypes.util.find_library("curl") or "libcurl.so.4")
    curl.curl_url.restype = ctypes.c_void_p
    curl.curl_url_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    curl.curl_url_get.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.c_uint]
    curl.curl_url_cleanup.argtypes = [ctypes.c_void_p]
    handle = curl.curl_url()
    try:
        if curl.curl_url_set(handle, 0, url.encode(), 0) != 0:   # CURLUPART_URL, no scheme guessing
            return None
        def part(which, flags=0):
            value = ctypes.c_char_p()
            return value.value.decode() if curl.curl_url_get(handle, which, ctypes.byref(value), flags) == 0 else None
        port = part(6, 1)   # CURLUPART_PORT with CURLU_DEFAULT_PORT
        return part(1), part(5), int(port) if port else None, part(7) or "/"
    finally:
        curl.curl_url_cleanup(handle)


def urllib3_reading(url):
    """urllib3's (requests', pip's) reading, or None."""
    from urllib3.util import parse_url
    try:
        parsed = parse_url(url)
    except Exception:
        return None
    if not parsed.scheme or not parsed.host:
        return None
    return parsed.scheme, parsed.host, parsed.port or {"http": 80, "https": 443}.get(parsed.scheme), parsed.path or "/"


def whatwg_reading(url):
    """The WHATWG URL standard's reading (browsers'; ada), or None."""
    import ada_url
    try:
        parsed = ada_url.URL(url)
    except ValueError:
        return None
    scheme = parsed.protocol.rstrip(":")
    return scheme, parsed.hostname, int(parsed.port) if parsed.port else {"http": 80, "https": 443}.get(scheme), parsed.pathname or "/"


def resolved(path):
    """Where a lenient server may take `path`: percent-encoded dots, slashes and backslashes
    decoded, backslashes as slashes, ";" parameters dropped from segments, dot segments removed."""
    import re
    path = re.sub("%2[eE]", ".", re.sub("%2[fF]|%5[cC]", "/", path)).replace("\\", "/")
    out = []
    for segment in path.split("/"):
        name = segment.split(";", 1)[0]
        if name == "..":
            if out:
                out.pop()
        elif name != ".":
            out.append(segment)
    return "/".join(out) or "/"


def tricky_urls():
    port = 8080
    hosts = ["good.test", "GOOD.test", "good.test.", "127.0.0.1", f"127.0.0.1:{port}", "127.1", "0x7f.0.0.1", "2130706433",
             "bare.test:8443", "bare.test:08443", "bare.test:8443:443", "bare.test:", "[::1]"]
    tricks = ["", "evil.test@", "good.test@", "good.test:443@", f"127.0.0.1:{port}\\@", "good.test\\@", "a@b@", "good.test#@",
              "good.test?@", "good.test%40"]
    paths = ["", "/", "/org", "/org/", "/org/x", "/organization", "/org/../x", "/org/%2e%2e/x", "/org/%2E%2e/x", "/org/..%2fx",
             "/org/%2fx", "/org\\..\\x", "/org/..;/x", "/org/.%2e/x", "/api", "/api/x", "/api/../x", "/api/%2e%2e/x", "/api%2f..%2fx",
             "/org?x=/../y", "/org#/../y", "/org//x", "/org/./x", "/org/%zz", "/ORG/x"]
    urls = []
    for scheme in ["https://", "http://", "HTTPS://", "https:/", "https:", "//", ""]:
        for trick in tricks:
            for host in hosts:
                for path in paths:
                    urls.append(scheme + trick + host + path)
    return urls


def test_what_the_broker_serves_for_a_url_every_reader_reaches_within_its_entry(readings_daemon):
    """Every tricky URL (schemes, user parts, backslashes, numeric hosts, ports, encoded dot
    segments): when the broker answers it with a session, libcurl, urllib3 and WHATWG (ada) each
    read the same scheme, host and port as the session's entry, and a path inside its scope even
    after a lenient server's decoding; and the broker refuses the known differentials."""
    served, disagreements = 0, []
    with Broker(readings_daemon.socket) as broker:
        for url in tricky_urls():
            try:
                session = broker.credential(url).session
            except (tokenbroker.NotServed, ValueError):
                continue
            served += 1
            scheme, host, port, scope = SERVED[session]
            for reader in (curl_reading, urllib3_reading, whatwg_reading):
                reading = reader(url)
                inside = reading is not None and reading[0].lower() == scheme and reading[1].lower() == host \
                    and (port is None or reading[2] == port) \
                    and (not scope or resolved(reading[3]) == scope or resolved(reading[3]).startswith(scope + "/"))
                if not inside:
                    disagreements.append((url, session, reader.__name__, reading))
        assert not disagreements, f"{len(disagreements)} readings leave the entry: {disagreements[:20]}"
        assert served >= 20, f"only {served} URLs served: the table means nothing"
        for url in ["http://127.0.0.1:8080\\@good.test/org", "https://good.test/org/%2e%2e/x", "https://good.test/org/..%2fx",
                    "https://good.test/org/..;/x", "bare.test:8443", "http://127.1:8080/api", "https://bare.test:8443:443/"]:
            with pytest.raises(tokenbroker.NotServed):
                broker.credential(url)
