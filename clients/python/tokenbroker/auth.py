"""One refresh and one retry per business request (the broker's guarantee 4), for `requests` and
`httpx`, with the same rules as the Swift library's `AuthRetryPolicy`:

- only a 401 whose Bearer challenge says `invalid_token`, or gives no error code at all; never a
  403, never `insufficient_scope` or `invalid_request`;
- only once: a second 401 goes back to the caller as it is;
- only when the request can be sent again: not a streamed body (consumed by the first attempt),
  and a non-idempotent method (POST, PATCH) only with an `Idempotency-Key` header.

The retry first calls the broker's Recover with the token that was actually sent: if another
worker already refreshed, the current token comes back at once; otherwise the caller joins the
one shared refresh.
"""

import functools
import re
from typing import Dict, Iterable, List, Tuple

from .client import Broker

IDEMPOTENT_METHODS = {"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"}

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


def should_retry(status: int, www_authenticate: Iterable[str], replayable: bool, attempt: int = 1) -> bool:
    """Whether to Recover and send once more (see the module's rules)."""
    if status != 401 or attempt != 1 or not replayable:
        return False
    bearer = [parameters for value in www_authenticate for scheme, parameters in parse_challenges(value)
              if scheme.lower() == "bearer"]
    if not bearer:
        return True   # no Bearer challenge at all: a 401 still says "this token was not accepted"
    return any("error" not in parameters or parameters["error"] == "invalid_token" for parameters in bearer)


def replayable(method: str, headers, body_is_stream: bool) -> bool:
    if body_is_stream:
        return False
    return method.upper() in IDEMPOTENT_METHODS or "idempotency-key" in {name.lower() for name in headers.keys()}


try:
    import requests
    from requests.auth import AuthBase as _RequestsAuthBase
except ImportError:  # pragma: no cover - requests is optional
    requests = None
    _RequestsAuthBase = object


class BrokerAuth(_RequestsAuthBase):
    """`requests` auth: the session's token from the broker, one Recover and one retry.

    Only a 401 for the request that carried this token counts: after a redirect to another
    origin (requests drops the Authorization header there), nothing is retried and the broker's
    token goes nowhere new.

    One Recover and one retry per business request, whatever redirects follow: `requests` runs
    the response hook on every response of the redirect chain, and builds each redirect from the
    request it was given. So the state lives with the request (its hook, which requests shares
    between the copies it makes for redirects), and after the Recover the request itself carries
    the fresh token: a redirect answering the retry is followed with that one (or none, to
    another origin), never with the rejected token, and is not recovered or retried again.
    """

    def __init__(self, broker: Broker, session: str):
        if requests is None:
            raise ImportError("BrokerAuth needs the requests package")
        self.broker = broker
        self.session = session

    def __call__(self, request):
        token = self.broker.token(self.session)
        request.headers["Authorization"] = token.authorization
        request.register_hook("response", functools.partial(self._on_response, _Attempt(token)))
        return request

    def _on_response(self, attempt, response, **kwargs):
        if attempt.retried:
            return response   # this business request had its one Recover and retry
        request = response.request
        # A request that no longer carries our token (redirected to another origin).
        if request.headers.get("Authorization") != attempt.sent.authorization:
            return response
        body = request.body
        stream = body is not None and not isinstance(body, (bytes, str))
        if not should_retry(response.status_code, _header_values(response.headers, "WWW-Authenticate"),
                            replayable(request.method, request.headers, stream)):
            return response
        attempt.retried = True
        fresh = self.broker.recover(self.session, attempt.sent.token)
        response.content  # read it, so that the connection can be reused
        response.close()
        # requests follows a redirect of the retry from this request (Session.send's, or the
        # previous hop's), and builds `response.next` from it: from now on it holds the fresh
        # token. The refused response keeps a copy as it was sent.
        response.request = request.copy()
        request.headers["Authorization"] = fresh.authorization
        retry = request.copy()
        second = response.connection.send(retry, **kwargs)
        second.history.append(response)
        second.request = retry
        return second


class _Attempt:
    """One business request's state: the token it was sent with, and whether it had its retry."""

    __slots__ = ("sent", "retried")

    def __init__(self, sent):
        self.sent = sent
        self.retried = False


def _header_values(headers, name: str) -> List[str]:
    # requests folds repeated headers into one, comma-separated: the challenge parser copes.
    value = headers.get(name)
    return [value] if value else []


try:
    import httpx
except ImportError:  # pragma: no cover - httpx is optional
    httpx = None


class HTTPXBrokerAuth(httpx.Auth if httpx is not None else object):
    """`httpx` auth, for Client and AsyncClient: the session's token from the broker, one
    Recover and one retry (only for a 401 to the request that carried this token). With
    AsyncClient the broker calls run in a worker thread, off the event loop.

    The flow is one generator per business request, and httpx follows redirects within each
    request the flow yields, handing the flow only the last response of the chain: the retry is
    the flow's last request, so a redirect answering it is followed (with the fresh token to the
    same origin, none to another) and never recovered or retried again."""

    requires_response_body = False

    def __init__(self, broker: Broker, session: str):
        if httpx is None:
            raise ImportError("HTTPXBrokerAuth needs the httpx package")
        self.broker = broker
        self.session = session

    def _retry(self, request, response, sent) -> bool:
        if response.request.headers.get("Authorization") != sent.authorization:
            return False   # redirected to another origin: not our token's 401
        stream = not isinstance(request.stream, httpx.ByteStream)
        return should_retry(response.status_code, response.headers.get_list("www-authenticate"),
                            replayable(request.method, request.headers, stream))

    def sync_auth_flow(self, request):
        token = self.broker.token(self.session)
        request.headers["Authorization"] = token.authorization
        response = yield request
        if self._retry(request, response, token):
            request.headers["Authorization"] = self.broker.recover(self.session, token.token).authorization
            yield request

    async def async_auth_flow(self, request):
        import anyio.to_thread
        token = await anyio.to_thread.run_sync(self.broker.token, self.session)
        request.headers["Authorization"] = token.authorization
        response = yield request
        if self._retry(request, response, token):
            fresh = await anyio.to_thread.run_sync(self.broker.recover, self.session, token.token)
            request.headers["Authorization"] = fresh.authorization
            yield request
