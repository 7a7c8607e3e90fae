"""The broker's socket API (io.tokenbroker.Broker) over varlink: NUL-terminated JSON messages on
a Unix stream socket."""

import json
import math
import os
import re
import socket
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional
from urllib.parse import urlsplit

from .errors import BrokerError, ConnectionLost, NoSuchSession, NotServed, error_from_reply

DEFAULT_SOCKET = "/run/tokenbroker/io.tokenbroker.Broker"


def user_socket() -> str:
    """This user's own broker's socket (tokenbroker serve --user, the user units):
    $XDG_RUNTIME_DIR/tokenbroker/io.tokenbroker.Broker (/run/user/UID when unset)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if not runtime.startswith("/"):
        runtime = f"/run/user/{os.getuid()}"
    return runtime + "/tokenbroker/io.tokenbroker.Broker"


def default_socket() -> str:
    """The broker a client talks to when it names none: $TOKENBROKER_SOCKET if set, else this
    user's own broker if something listens on its socket, else the system's."""
    named = os.environ.get("TOKENBROKER_SOCKET")
    if named:
        return named
    user = user_socket()
    try:
        if stat.S_ISSOCK(os.lstat(user).st_mode):
            # (A stopped socket unit leaves its file: only one something listens on counts.)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.setblocking(False)
                probe.connect(user)
            return user
    except BlockingIOError:
        return user
    except OSError:
        pass
    return DEFAULT_SOCKET
INTERFACE = "io.tokenbroker.Broker"
#: Largest reply accepted (a token reply is a few kilobytes; Status of many sessions more).
MAX_REPLY = 16 << 20
#: Longest URL Credential takes, in bytes (UTF-8), as the contract says.
MAX_URL = 2048
#: Longest URL GetProof takes, in bytes, and the longest nonce, as the contract says.
MAX_PROOF_URL = 4096
MAX_NONCE = 512

_METHOD = re.compile(r"[A-Z]{1,16}")
#: RFC 9449 §8.1's NQCHAR: visible ASCII but `"` and `\`.
_NONCE = re.compile(r'[\x21\x23-\x5B\x5D-\x7E]+')


@dataclass(frozen=True)
class Token:
    """A current access token. Its repr never shows the token itself."""

    token: str = field(repr=False)
    token_type: str = "Bearer"
    expires_at: Optional[int] = None
    generation: int = 0

    @property
    def authorization(self) -> str:
        """The value of an Authorization header."""
        return f"{self.token_type} {self.token}"

    @classmethod
    def from_parameters(cls, parameters: Dict[str, Any]) -> "Token":
        return cls(token=parameters["token"], token_type=parameters.get("tokenType", "Bearer"),
                   expires_at=parameters.get("expiresAt"), generation=parameters.get("generation", 0))


@dataclass(frozen=True, repr=False)
class Proof:
    """GetProof's answer: the token, and the DPoP proof (RFC 9449) for the one request it was
    made for — None for a bearer session. Neither the token nor the proof is in its repr."""

    token: Token
    proof: Optional[str] = None

    def headers(self) -> Dict[str, str]:
        """The headers to send: `Authorization: <type> <token>`, and `DPoP: <proof>` when there
        is a proof."""
        headers = {"Authorization": self.token.authorization}
        if self.proof is not None:
            headers["DPoP"] = self.proof
        return headers

    def __repr__(self) -> str:
        return f"Proof(token={self.token!r}, proof={'<DPoP proof>' if self.proof is not None else None})"


#: The longest minimum validity the broker takes, in seconds (a year).
MAX_MIN_VALID = 31_536_000


def whole_seconds(duration: float) -> int:
    """A minimum validity as the contract's whole seconds (rounded up); ValueError outside 1
    second to a year, TypeError for what is not a number."""
    if isinstance(duration, bool) or not isinstance(duration, (int, float)):
        raise TypeError("min_valid must be a number of seconds")
    if not 0 < duration <= MAX_MIN_VALID:
        raise ValueError(f"min_valid must lie between 1 and {MAX_MIN_VALID} seconds")
    return max(1, math.ceil(duration))


def proof_url(url: str) -> Optional[str]:
    """The part of `url` a DPoP proof names (its `htu`, RFC 9449 §4.2): scheme, host and port,
    and path, without userinfo, query and fragment; None unless GetProof takes it (an http or
    https URL of visible ASCII with a host, at most 4096 bytes). Query and fragment never go to
    the broker."""
    if not isinstance(url, str) or not url.isascii() or not all(" " < c < "\x7f" for c in url):
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    authority = parts.netloc.rpartition("@")[2]
    if parts.scheme.lower() not in ("http", "https") or not authority:
        return None
    target = f"{parts.scheme}://{authority}{parts.path or '/'}"
    return target if len(target) <= MAX_PROOF_URL else None


def key_parameters(resource: Optional[str], scope: Optional[str]) -> Dict[str, str]:
    """A key's parameters (`resource`, `scope`), each given or not; the broker checks them."""
    parameters: Dict[str, str] = {}
    for name, value in (("resource", resource), ("scope", scope)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None")
        parameters[name] = value
    return parameters


def valid_method(method: Any) -> bool:
    """Whether GetProof takes `method`: 1 to 16 upper-case letters."""
    return isinstance(method, str) and _METHOD.fullmatch(method) is not None


def valid_nonce(nonce: Any) -> bool:
    """Whether GetProof takes `nonce` (a resource server's `DPoP-Nonce`): 1 to 512 visible
    ASCII characters but `"` and `\\`."""
    return isinstance(nonce, str) and len(nonce) <= MAX_NONCE and _NONCE.fullmatch(nonce) is not None


@dataclass(frozen=True)
class Credential:
    """Credential's answer: the session that serves the URL, and its token (whose repr leaves
    the token out)."""

    session: str
    token: Token


@dataclass(frozen=True)
class Event:
    """One Watch event: a new token, or the session signed out."""

    event: str
    generation: int
    token: Optional[Token] = None
    token_serial: Optional[int] = None


class _Connection:
    """One connection to the broker: send a call, read its replies."""

    def __init__(self, path: str, timeout: float):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as error:
            self.sock.close()
            raise ConnectionLost(f"cannot connect to {path}: {error.strerror or error}") from None
        self.buffer = b""

    def send(self, message: Dict[str, Any]) -> None:
        try:
            self.sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\0")
        except OSError as error:
            raise ConnectionLost(f"the broker closed the connection ({error.strerror or error})") from None

    def receive(self) -> Dict[str, Any]:
        while b"\0" not in self.buffer:
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                raise ConnectionLost("the broker did not answer in time", timed_out=True) from None
            except OSError as error:
                raise ConnectionLost(f"the broker closed the connection ({error.strerror or error})") from None
            if not chunk:
                raise ConnectionLost("the broker closed the connection")
            self.buffer += chunk
            if len(self.buffer) > MAX_REPLY:
                raise ConnectionLost("a reply larger than the client accepts")
        message, _, self.buffer = self.buffer.partition(b"\0")
        try:
            reply = json.loads(message)
        except ValueError:
            raise ConnectionLost("a reply that is not JSON") from None
        if not isinstance(reply, dict):
            raise ConnectionLost("a reply that is not a JSON object")
        return reply

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Broker:
    """A client of the broker's socket.

    Each thread gets a connection of its own (a Recover waiting for an upstream refresh never
    holds up another thread's GetToken), made again in a child after `fork()`. If the broker
    has restarted, GetToken, Recover, GetProof, Credential and Status are sent once more on a new
    connection — only when the old one failed before the call was written, or turned out closed
    when the reply was awaited (a broker restart); never after a timeout. Other calls are never
    re-sent.
    """

    #: Calls that may be sent twice: reads, and Recover, GetProof or Credential with a rejected
    #: token (with the same rejected token, a second call gets the current token back; a second
    #: GetProof, another proof).
    RESENDABLE = {"GetToken", "Recover", "GetProof", "Credential", "Status"}

    def __init__(self, socket_path: Optional[str] = None, timeout: float = 45.0):
        self.path = socket_path or default_socket()
        self.timeout = timeout
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"Broker({self.path!r})"

    def _connection(self) -> Optional[_Connection]:
        connection = getattr(self._local, "connection", None)
        # A connection made before a fork() belongs to the parent.
        if connection is not None and getattr(self._local, "pid", None) != os.getpid():
            self._local.connection = None
            return None
        return connection

    def close(self) -> None:
        """Closes this thread's connection."""
        connection = self._connection()
        if connection:
            connection.close()
        self._local.connection = None

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls

    def call(self, method: str, parameters: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Calls `io.tokenbroker.Broker.<method>`; returns the reply's parameters or raises the
        contract's error."""
        message = {"method": f"{INTERFACE}.{method}", "parameters": parameters or {}}
        for attempt in (1, 2):
            connection = self._connection()
            reused = connection is not None
            try:
                if connection is None:
                    connection = _Connection(self.path, self.timeout)
                    self._local.connection, self._local.pid = connection, os.getpid()
                connection.send(message)
                reply = connection.receive()
                break
            except ConnectionLost as error:
                self.close()
                # A kept connection the broker closed (it restarted) fails at once: the call
                # never reached a broker that could act on it. A timeout might have.
                if attempt == 2 or not reused or method not in self.RESENDABLE or error.timed_out:
                    raise
            except BaseException:
                # Interrupted (a signal, KeyboardInterrupt) with a reply maybe still on its way:
                # that connection must not serve the next call.
                self.close()
                raise
        if "error" in reply:
            raise error_from_reply(reply["error"], reply.get("parameters") or {})
        return reply.get("parameters") or {}

    def token(self, session: str, min_valid: Optional[float] = None, resource: Optional[str] = None,
              scope: Optional[str] = None) -> Token:
        """The session's current access token (refreshed first when it has expired). With
        `min_valid` (seconds, rounded up to whole ones, 1 to a year), one that stays valid that
        long: a token that ends sooner is refreshed first, in the session's one refresh;
        LifetimeTooShort when the issuer's tokens live less than that. With `resource` (an
        RFC 8707 resource, an absolute URL) and/or `scope` (space-separated words), the
        session's token narrowed to that key, one the session allows (AllowResources=,
        AllowScopes=; InvalidParameter otherwise): its own token and single refresh."""
        parameters: Dict[str, Any] = {"session": session, **key_parameters(resource, scope)}
        if min_valid is not None:
            parameters["minValid"] = whole_seconds(min_valid)
        return Token.from_parameters(self.call("GetToken", parameters))

    def recover(self, session: str, rejected: str, resource: Optional[str] = None, scope: Optional[str] = None) -> Token:
        """A request made with `rejected` was refused as an invalid token: the token to retry
        with (the current one if `rejected` is stale, else the result of the one shared refresh);
        `resource` and `scope`: the key `rejected` was asked for with, as `token` takes."""
        return Token.from_parameters(self.call("Recover", {"session": session, "rejected": rejected,
                                                           **key_parameters(resource, scope)}))

    def proof(self, session: str, method: str, url: str, nonce: Optional[str] = None,
              rejected: Optional[str] = None, min_valid: Optional[float] = None, resource: Optional[str] = None,
              scope: Optional[str] = None) -> Proof:
        """The session's current token with a DPoP proof for one request of `method` to `url`
        (GetProof), signed in the broker with the session's key, which never leaves it; send
        `Proof.headers()` with that request only. A bearer session's answer has no proof (and
        the headers are `Authorization: Bearer <token>` alone). `nonce` is the resource
        server's `DPoP-Nonce`, if it asked for one; with `rejected` (the token a request was
        refused with as invalid), as `recover`.

        Only the URL's scheme, host, port and path go to the broker. Raises TypeError and
        ValueError for what GetProof does not take (a method other than 1 to 16 upper-case
        letters, a URL other than http or https of visible ASCII with a host and at most 4096
        bytes without its query, a nonce other than 1 to 512 visible ASCII characters without
        `"` or `\\`, an empty `rejected`) before asking, InvalidParameter (a ValueError too)
        for what the broker refuses, and the session's errors as `token` does. Neither the URL
        nor a token goes into an error's message."""
        if not isinstance(method, str) or not isinstance(url, str):
            raise TypeError("method and url must be str")
        if nonce is not None and not isinstance(nonce, str):
            raise TypeError("nonce must be a str or None")
        if rejected is not None and not isinstance(rejected, str):
            raise TypeError("rejected must be a str or None")
        if not valid_method(method):
            raise ValueError("GetProof takes a method of 1 to 16 upper-case letters (GET, POST, ...)")
        target = proof_url(url)
        if target is None:
            raise ValueError(f"GetProof takes an http or https URL of visible ASCII with a host, at most {MAX_PROOF_URL} "
                             "bytes without its query")
        if nonce is not None and not valid_nonce(nonce):
            raise ValueError(f"GetProof takes a nonce of 1 to {MAX_NONCE} visible ASCII characters without '\"' or '\\'")
        if rejected == "":
            raise ValueError("rejected must not be empty")
        parameters: Dict[str, Any] = {"session": session, "method": method, "uri": target, **key_parameters(resource, scope)}
        if nonce is not None:
            parameters["nonce"] = nonce
        if rejected is not None:
            parameters["rejected"] = rejected
        if min_valid is not None:
            if rejected is not None:
                raise ValueError("min_valid does not go with rejected (a recovery takes the next token, whatever its life)")
            parameters["minValid"] = whole_seconds(min_valid)
        reply = self.call("GetProof", parameters)
        return Proof(token=Token.from_parameters(reply), proof=reply.get("proof"))

    def credential(self, url: str, rejected: Optional[str] = None, resource: Optional[str] = None,
                   scope: Optional[str] = None) -> Credential:
        """The token for `url`, for credential helpers: that of the session whose `Serves=` entry
        matches it most specifically among the sessions this caller may use. A URL without a
        scheme (a bare `host:port`) is served by none: it could be sent over plain HTTP. With `rejected` (the token a request to it was refused with), as `recover`;
        `resource` and `scope`: a key of that session, as `token` takes.

        Raises NotServed (a NoSuchSession) when no such session serves the URL, ValueError for an
        empty URL or one longer than the contract's 2048 bytes, and the session's errors as
        `token` does. Neither the URL nor a token goes into an error's message."""
        if not isinstance(url, str):
            raise TypeError("url must be a str")
        if rejected is not None and not isinstance(rejected, str):
            raise TypeError("rejected must be a str or None")
        if not url or len(url.encode("utf-8", "surrogatepass")) > MAX_URL:
            raise ValueError(f"a URL of 1 to {MAX_URL} bytes")
        parameters: Dict[str, Any] = {"url": url, **key_parameters(resource, scope)}
        if rejected is not None:
            parameters["rejected"] = rejected
        try:
            reply = self.call("Credential", parameters)
        except NoSuchSession as error:
            if error.session:
                raise
            raise NotServed("NoSuchSession: no session this caller may use serves the URL", error.parameters) from None
        return Credential(session=reply["session"], token=Token.from_parameters(reply))

    def status(self) -> List[Dict[str, Any]]:
        """The sessions this caller may use, as Status reports them (no tokens)."""
        return list(self.call("Status").get("sessions", []))

    def watch(self, session: str) -> Iterator[Event]:
        """The session's events, on a connection of its own: first its current state, then every
        new token and logout. Ends when the broker ends the stream; raises its errors."""
        connection = _Connection(self.path, self.timeout)
        connection.sock.settimeout(None)   # events come when they come; close the iterator to stop
        try:
            connection.send({"method": f"{INTERFACE}.Watch", "parameters": {"session": session}, "more": True})
            while True:
                reply = connection.receive()
                if "error" in reply:
                    raise error_from_reply(reply["error"], reply.get("parameters") or {})
                parameters = reply.get("parameters") or {}
                token = Token.from_parameters(parameters) if parameters.get("token") else None
                yield Event(event=parameters.get("event", ""), generation=parameters.get("generation", 0), token=token,
                            token_serial=parameters.get("tokenSerial"))
                if not reply.get("continues"):
                    return
        finally:
            connection.close()


__all__ = ["Broker", "Token", "Proof", "Credential", "Event", "BrokerError", "DEFAULT_SOCKET", "proof_url", "valid_method",
           "valid_nonce"]
