"""One refresh and one retry per business request (the broker's guarantee 4), for `requests` and
`httpx`, with the same rules as the Swift library's `AuthRetryPolicy`, and DPoP (RFC 9449).

Every request is sent with what the broker's GetProof gives for its method and URL: a DPoP
session's token (`Authorization: DPoP <token>`) and a fresh proof for that one request (`DPoP:
<proof>`, signed in the broker, whose key never leaves it); a bearer session's token alone
(`Authorization: Bearer <token>`, as before DPoP). A request GetProof cannot name (a method
other than 1 to 16 upper-case letters, a URL other than http or https) gets GetToken's token
if it is a bearer one, and a ValueError for a DPoP session.

A refused request is sent again at most twice — each of these at most once, in either order:

- the resource server asks for a DPoP nonce: a 401 whose `DPoP` challenge says
  `use_dpop_nonce`, with a `DPoP-Nonce` other than the one the proof carried: sent once more
  with the same token and a proof that carries that nonce (RFC 9449 §9);
- the token was refused: a 401 whose Bearer or DPoP challenge says `invalid_token`, or gives no
  error code at all (never a 403, never `insufficient_scope`, `invalid_request` or
  `invalid_dpop_proof`): GetProof with the token that was actually sent as `rejected`, which
  answers as Recover does — the current token at once if another worker already refreshed,
  otherwise the result of the one shared refresh — and sent once more with it;

and only when the request can be sent again: not a streamed body (consumed by the first
attempt), and a non-idempotent method (POST, PATCH) only with an `Idempotency-Key` header. So a
request is sent at most three times. The last `DPoP-Nonce` an origin named is kept by the auth
object and put in the proofs of its next requests there, which saves the nonce round trip.
"""

import functools
import re
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple
from urllib.parse import urljoin, urlparse, urlsplit

from .client import Broker, Proof, proof_url, valid_method, valid_nonce

IDEMPOTENT_METHODS = {"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"}
#: The most origins an auth object keeps a DPoP nonce for (then it forgets them all).
MAX_NONCES = 256

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TOKEN68 = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


def parse_challenges(value: str) -> List[Tuple[str, Dict[str, str]]]:
    """The challenges of one WWW-Authenticate value (RFC 9110 §11.6.1): scheme and parameters
    (names lower-cased, quoted values unquoted)."""
    challenges: List[Tuple[str, Dict[str, str]]] = []
    position = 0

    def skip(characters: str) -> None:
        nonlocal position
        while position < len(value) and value[position] in characters:
            position += 1

    def parameter(into: Dict[str, str]) -> bool:
        nonlocal position
        mark = position
        name = _TOKEN.match(value, position)
        if not name:
            return False
        position = name.end()
        skip(" \t")
        if position >= len(value) or value[position] != "=":
            position = mark
            return False
        position += 1
        skip(" \t")
        if position < len(value) and value[position] == '"':
            position += 1
            text = []
            while position < len(value) and value[position] != '"':
                if value[position] == "\\" and position + 1 < len(value):
                    position += 1
                text.append(value[position])
                position += 1
            position += 1
            into[name.group().lower()] = "".join(text)
        else:
            token = _TOKEN.match(value, position)
            if not token:
                position = mark
                return False
            position = token.end()
            into[name.group().lower()] = token.group()
        return True

    while True:
        skip(" \t,")
        scheme = _TOKEN.match(value, position)
        if not scheme:
            break
        position = scheme.end()
        parameters: Dict[str, str] = {}
        skip(" \t")
        if not parameter(parameters):
            blob = _TOKEN68.match(value, position)
            if blob:
                position = blob.end()
        while True:
            skip(" \t")
            if position >= len(value) or value[position] != ",":
                break
            mark = position
            skip(" \t,")
            if not parameter(parameters):
                position = mark
                break
        challenges.append((scheme.group(), parameters))
    return challenges




def _challenges(www_authenticate: Iterable[str], schemes: Tuple[str, ...]) -> List[Dict[str, str]]:
    return [parameters for value in www_authenticate for scheme, parameters in parse_challenges(value)
            if scheme.lower() in schemes]


def should_retry(status: int, www_authenticate: Iterable[str], replayable: bool, attempt: int = 1, scheme: str = "Bearer") -> bool:
    """Whether to Recover and send once more (see the module's rules): only the challenges of
    the scheme the request was sent with (`Bearer`, or `DPoP` with a proof) are read — a server
    that takes both sends both (RFC 9449 §7.1), and a bare one of the other says nothing."""
    if status != 401 or attempt != 1 or not replayable:
        return False
    challenges = _challenges(www_authenticate, (scheme.lower(),))
    if not challenges:
        return True   # no challenge of that scheme at all: a 401 still says "this token was not accepted"
    return any("error" not in parameters or parameters["error"] == "invalid_token" for parameters in challenges)


class Decision(NamedTuple):
    """What to do with a response to a request sent with a GetProof answer: `deliver` it,
    `recover` (GetProof with the token sent as `rejected`) and send once more, or send once more
    with a proof that carries `nonce`."""

    action: str
    nonce: Optional[str] = None


DELIVER = Decision("deliver")
RECOVER = Decision("recover")


def decide_with_proof(status: int, www_authenticate: Iterable[str], nonce: Optional[str], sent_nonce: Optional[str],
                      nonce_retried: bool, recovered: bool, replayable: bool, scheme: str = "DPoP") -> Decision:
    """The Swift library's `AuthRetryPolicy.decideWithProof`: a 401 whose DPoP challenge says
    `use_dpop_nonce`, with a `DPoP-Nonce` (`nonce`) other than the one the proof carried
    (`sent_nonce`), is sent once more with it (unless `nonce_retried`); otherwise
    `should_retry`'s rule, unless `recovered`. Nothing for a request that cannot be sent again.
    A nonce GetProof would not take is not retried with."""
    if status != 401 or not replayable:
        return DELIVER
    values = list(www_authenticate)
    if scheme.lower() == "dpop" and any(parameters.get("error") == "use_dpop_nonce" for parameters in _challenges(values, ("dpop",))):
        if nonce_retried or not nonce or nonce == sent_nonce or not valid_nonce(nonce):
            return DELIVER
        return Decision("nonce", nonce)
    if recovered:
        return DELIVER
    return RECOVER if should_retry(status, values, replayable, scheme=scheme) else DELIVER


def replayable(method: str, headers, body_is_stream: bool) -> bool:
    if body_is_stream:
        return False
    return method.upper() in IDEMPOTENT_METHODS or "idempotency-key" in {name.lower() for name in headers.keys()}


def _obtain(broker: Broker, session, method: str, url: str, nonce: Optional[str] = None,
            rejected: Optional[str] = None) -> Proof:
    """GetProof's answer for a request; for one it cannot name, GetToken's (or Recover's) bearer
    token alone. `session`: a name, or (name, resource, scope) for a key of it."""
    name, resource, scope = session if isinstance(session, tuple) else (session, None, None)
    if valid_method(method) and proof_url(url) is not None:
        return broker.proof(name, method, url, nonce=nonce, rejected=rejected, resource=resource, scope=scope)
    token = (broker.recover(name, rejected, resource=resource, scope=scope) if rejected is not None
             else broker.token(name, resource=resource, scope=scope))
    if token.token_type.lower() == "dpop":
        raise ValueError("a DPoP session's token needs a proof, and GetProof cannot name this request "
                         "(a method of 1 to 16 upper-case letters and an http or https URL)")
    return Proof(token=token)


def _attach(headers, proven: Proof) -> None:
    """Puts the answer's headers on a request (and takes off a DPoP header it has no proof for)."""
    headers["Authorization"] = proven.token.authorization
    if proven.proof is not None:
        headers["DPoP"] = proven.proof
    elif "DPoP" in headers:
        del headers["DPoP"]


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme.lower()}://{parts.netloc.rpartition('@')[2].lower()}"


class _Nonces:
    """The last `DPoP-Nonce` each origin named (RFC 9449 §8.2), for the proofs of the next
    requests there."""

    def __init__(self):
        self._by_origin: Dict[str, str] = {}

    def get(self, url: str) -> Optional[str]:
        try:
            return self._by_origin.get(_origin(url))
        except ValueError:
            return None

    def learn(self, url: str, nonce: Optional[str]) -> None:
        if not nonce or not valid_nonce(nonce):
            return
        try:
            origin = _origin(url)
        except ValueError:
            return
        if origin not in self._by_origin and len(self._by_origin) >= MAX_NONCES:
            self._by_origin.clear()
        self._by_origin[origin] = nonce


class _Attempt:
    """One business request's state: what it was last sent with (the GetProof answer, and the
    nonce its proof carried), and which of its two retries it has had."""

    __slots__ = ("sent", "nonce", "nonce_retried", "recovered")

    def __init__(self, sent: Proof, nonce: Optional[str]):
        self.sent = sent
        self.nonce = nonce
        self.nonce_retried = False
        self.recovered = False

    def carried_by(self, headers) -> bool:
        """Whether a request's headers are the ones it was last sent with."""
        if headers.get("Authorization") != self.sent.token.authorization:
            return False
        return self.sent.proof is None or headers.get("DPoP") == self.sent.proof

    def given_nonce(self, headers) -> Optional[str]:
        """The response's `DPoP-Nonce`, for a request that carried a proof (a bearer token has
        no proof to put a nonce in)."""
        return headers.get("DPoP-Nonce") if self.sent.proof is not None else None

    def next(self, decision: Decision) -> Tuple[Optional[str], Optional[str]]:
        """Records a retry: the nonce and the rejected token to ask GetProof with."""
        if decision.action == "nonce":
            self.nonce_retried = True
            self.nonce = decision.nonce
            return self.nonce, None
        self.recovered = True
        return self.nonce, self.sent.token.token


try:
    import requests
    from requests.auth import AuthBase as _RequestsAuthBase
    from requests.sessions import SessionRedirectMixin as _SessionRedirectMixin
    from requests.utils import requote_uri as _requote_uri
except ImportError:  # pragma: no cover - requests is optional
    requests = None
    _RequestsAuthBase = object
    _SessionRedirectMixin = None


class BrokerAuth(_RequestsAuthBase):
    """`requests` auth: the session's token, and its DPoP proof, from the broker's GetProof;
    the nonce retry and the one recovery and retry (see the module's rules).

    Only a 401 for the request that carried this token counts: after a redirect to another
    origin (requests drops the Authorization header there, and this auth the DPoP header),
    nothing is retried and the broker's token and proofs go nowhere new.

    The retries are per business request, whatever redirects follow: `requests` runs the
    response hook on every response of the redirect chain, and builds each redirect from the
    request it was given. So the state lives with the request (its hook, which requests shares
    between the copies it makes for redirects), and after a retry the request itself carries
    the fresh token: a redirect answering the retry is followed with that one (or none, to
    another origin), never with the rejected token, and is not recovered or retried again.

    A DPoP proof names one method and URL: answered with a redirect to the same origin, the
    request gets a new proof for where requests goes next (its method and URL worked out as
    requests does), so the redirect's `next` (allow_redirects=False) carries it too.
    """

    def __init__(self, broker: Broker, session: str, resource: Optional[str] = None, scope: Optional[str] = None):
        if requests is None:
            raise ImportError("BrokerAuth needs the requests package")
        self.broker = broker
        # With a key (resource, scope), its token: the session's narrowed, as Broker.token gives it.
        self.session = session if resource is None and scope is None else (session, resource, scope)
        self._nonces = _Nonces()

    def __call__(self, request):
        nonce = self._nonces.get(request.url)
        proven = _obtain(self.broker, self.session, request.method, request.url, nonce)
        _attach(request.headers, proven)
        request.register_hook("response", functools.partial(self._on_response, _Attempt(proven, nonce)))
        return request

    def _on_response(self, attempt, response, **kwargs):
        request = response.request
        # A request that no longer carries our token (redirected to another origin).
        if not attempt.carried_by(request.headers):
            return response
        while True:
            if attempt.sent.proof is not None:
                self._nonces.learn(request.url, response.headers.get("DPoP-Nonce"))
            if response.is_redirect:
                if attempt.sent.proof is not None:
                    self._prove_redirect(attempt, response)
                return response
            body = request.body
            stream = body is not None and not isinstance(body, (bytes, str))
            decision = decide_with_proof(response.status_code, _header_values(response.headers, "WWW-Authenticate"),
                                         attempt.given_nonce(response.headers), attempt.nonce, attempt.nonce_retried,
                                         attempt.recovered, replayable(request.method, request.headers, stream),
                                         "Bearer" if attempt.sent.proof is None else "DPoP")
            if decision.action == "deliver":
                return response
            nonce, rejected = attempt.next(decision)
            fresh = _obtain(self.broker, self.session, request.method, request.url, nonce, rejected)
            response.content  # read it, so that the connection can be reused
            response.close()
            # requests follows a redirect of the retry from this request (Session.send's, or the
            # previous hop's), and builds `response.next` from it: from now on it holds the fresh
            # token. The refused response keeps a copy as it was sent.
            response.request = request.copy()
            _attach(request.headers, fresh)
            attempt.sent = fresh
            retry = request.copy()
            second = response.connection.send(retry, **kwargs)
            second.history = [*response.history, response]
            second.request = retry
            response = second

    def _prove_redirect(self, attempt, response):
        """A proof for the redirect's next hop, made before requests copies this request for it
        (none to another origin, where requests drops the token too)."""
        request = response.request
        hop = _requests_redirect(response)
        response.request = request.copy()   # the redirect keeps the request as it was sent
        if hop is None or _REDIRECTS.should_strip_auth(request.url, hop[1]):
            del request.headers["DPoP"]
            return
        method, url = hop
        nonce = self._nonces.get(url)
        fresh = _obtain(self.broker, self.session, method, url, nonce)
        _attach(request.headers, fresh)
        attempt.sent, attempt.nonce = fresh, nonce


_REDIRECTS = _SessionRedirectMixin() if _SessionRedirectMixin is not None else None


def _requests_redirect(response) -> Optional[Tuple[str, str]]:
    """The method and URL requests sends a redirect's next hop with (Session.resolve_redirects'
    own steps, without sending); None if there is none."""
    location = _REDIRECTS.get_redirect_target(response)
    if not location:
        return None
    if location.startswith("//"):
        location = urlparse(response.url).scheme + ":" + location
    parsed = urlparse(location)
    url = urljoin(response.url, _requote_uri(parsed.geturl())) if not parsed.netloc else _requote_uri(parsed.geturl())
    hop = response.request.copy()
    _REDIRECTS.rebuild_method(hop, response)
    return hop.method, url


def _header_values(headers, name: str) -> List[str]:
    # requests folds repeated headers into one, comma-separated: the challenge parser copes.
    value = headers.get(name)
    return [value] if value else []


try:
    import httpx
except ImportError:  # pragma: no cover - httpx is optional
    httpx = None


class HTTPXBrokerAuth(httpx.Auth if httpx is not None else object):
    """`httpx` auth, for Client and AsyncClient: the session's token, and its DPoP proof, from
    the broker's GetProof; the nonce retry and the one recovery and retry (see the module's
    rules; only for a 401 to the request that carried this token). With AsyncClient the broker
    calls run in a worker thread, off the event loop.

    The flow is one generator per business request, and httpx follows redirects within each
    request the flow yields, handing the flow only the last response of the chain: the retry is
    the flow's last request, so a redirect answering it is followed (with the fresh token to the
    same origin, none to another) and never recovered or retried again.

    httpx builds those redirects itself, out of the flow's reach, and copies every header but
    Authorization to another origin: so for a DPoP session a redirect carries the first
    request's proof, which names another URL (a DPoP resource refuses it; to another origin it
    goes without the token it was made for), and a refusal after a redirect is not retried.
    Follow a DPoP session's redirects yourself (`follow_redirects=False`, then send
    `response.next_request` with this auth, which gives it its own proof, when it goes to the
    same origin), or use `BrokerAuth`.
    """

    requires_response_body = False

    def __init__(self, broker: Broker, session: str, resource: Optional[str] = None, scope: Optional[str] = None):
        if httpx is None:
            raise ImportError("HTTPXBrokerAuth needs the httpx package")
        self.broker = broker
        # With a key (resource, scope), its token: the session's narrowed, as Broker.token gives it.
        self.session = session if resource is None and scope is None else (session, resource, scope)
        self._nonces = _Nonces()

    def _start(self, request) -> Tuple[str, str, Optional[str]]:
        url = str(request.url)
        return request.method, url, self._nonces.get(url)

    def _decide(self, request, response, attempt) -> Decision:
        if not attempt.carried_by(response.request.headers):
            return DELIVER   # redirected to another origin: not our token's 401
        if attempt.sent.proof is not None:
            if response.request is not request:
                return DELIVER   # a redirect httpx followed with this request's proof: not made for it
            self._nonces.learn(str(request.url), response.headers.get("DPoP-Nonce"))
        stream = not isinstance(request.stream, httpx.ByteStream)
        return decide_with_proof(response.status_code, response.headers.get_list("www-authenticate"),
                                 attempt.given_nonce(response.headers), attempt.nonce, attempt.nonce_retried, attempt.recovered,
                                 replayable(request.method, request.headers, stream), "Bearer" if attempt.sent.proof is None else "DPoP")

    def sync_auth_flow(self, request):
        method, url, nonce = self._start(request)
        attempt = _Attempt(_obtain(self.broker, self.session, method, url, nonce), nonce)
        _attach(request.headers, attempt.sent)
        while True:
            response = yield request
            decision = self._decide(request, response, attempt)
            if decision.action == "deliver":
                return
            nonce, rejected = attempt.next(decision)
            attempt.sent = _obtain(self.broker, self.session, method, url, nonce, rejected)
            _attach(request.headers, attempt.sent)

    async def async_auth_flow(self, request):
        import anyio.to_thread
        method, url, nonce = self._start(request)
        proven = await anyio.to_thread.run_sync(functools.partial(_obtain, self.broker, self.session, method, url, nonce))
        attempt = _Attempt(proven, nonce)
        _attach(request.headers, attempt.sent)
        while True:
            response = yield request
            decision = self._decide(request, response, attempt)
            if decision.action == "deliver":
                return
            nonce, rejected = attempt.next(decision)
            attempt.sent = await anyio.to_thread.run_sync(
                functools.partial(_obtain, self.broker, self.session, method, url, nonce, rejected))
            _attach(request.headers, attempt.sent)
