"""A `keyring` backend that answers with the broker's token for a URL, for pip, uv and twine.

`get_password(service, username)` asks the broker's Credential for `service` (pip passes the
index URL, then its `host:port`; twine the repository URL): the token of the session whose
`Serves=` entry matches it for this user, as the password, whatever the username. A service
without a scheme (pip's `host:port`) is nobody's: it may be an `http://` index. A URL that
no session serves for this user is None, so keyring's chainer and pip fall through to what
comes next (another backend, a prompt, or the server's 401). So is a URL a DPoP session
(`DPoP=yes`) serves: its token is bound to the broker's key and good only with a proof for each
request (RFC 9449), which keyring's password cannot carry.

`get_credential(service, username)` returns the username asked for, else
`$TOKENBROKER_KEYRING_USERNAME`, else `oauth2`, with the token as the password.

The broker owns its sessions: `set_password` and `delete_password` raise PasswordSetError and
PasswordDeleteError (which are NotImplementedError too, so that keyring's chainer passes them
on to the next backend instead of failing).

Selection: `PYTHON_KEYRING_BACKEND=tokenbroker.keyring_backend.TokenBrokerKeyring` (or
`default-keyring` in keyringrc.cfg) always works, with `$TOKENBROKER_SOCKET` or the system
socket. keyring also finds the backend through the package's `keyring.backends` entry point,
but picks it on its own only when `$TOKENBROKER_SOCKET` is set (priority 9: ahead of the
platform keyrings, and first in the chainer); without it the priority is below keyring's
fail backend, so it is never chosen automatically.

Errors other than "not served" (the broker unreachable, the session signed out, a failed
refresh, ...) raise KeyringError with the broker's message, which never holds a token or
the URL. Needs the `keyring` package: `pip install 'tokenbroker[keyring]'`.
"""

import os
from typing import Optional

from keyring import credentials, errors
from keyring.backend import KeyringBackend

from .client import MAX_URL, Broker
from .errors import BrokerError, NotServed

#: The username `get_credential` answers with when none is asked for or configured.
DEFAULT_USERNAME = "oauth2"
USERNAME_VARIABLE = "TOKENBROKER_KEYRING_USERNAME"
#: The priority when `$TOKENBROKER_SOCKET` is set: above the platform keyrings (5), below
#: the chainer (10), which then asks this backend first.
PRIORITY_WITH_SOCKET = 9
#: Otherwise: below keyring's fail backend (0) and null backend (-1), so never auto-selected.
PRIORITY_WITHOUT_SOCKET = -2


class _classproperty:
    """A read-only property of the class (keyring reads `priority` from the class and from
    instances); keyring's own helper has moved between its versions."""

    def __init__(self, fget):
        self.fget = fget

    def __get__(self, instance, owner=None):
        return self.fget(owner if owner is not None else type(instance))


class BrokerOwnsCredentials(errors.PasswordSetError, NotImplementedError):
    """The broker owns its sessions' tokens: nothing is stored through keyring."""


class BrokerOwnsDeletion(errors.PasswordDeleteError, NotImplementedError):
    """The broker owns its sessions' tokens: log out with `tokenbroker ctl logout`."""


class TokenBrokerKeyring(KeyringBackend):
    """The broker's token for a URL as the password (see the module's documentation)."""

    @_classproperty
    def priority(cls) -> float:
        return PRIORITY_WITH_SOCKET if os.environ.get("TOKENBROKER_SOCKET") else PRIORITY_WITHOUT_SOCKET

    def __init__(self, broker: Optional[Broker] = None):
        super().__init__()
        self._broker = broker

    @property
    def broker(self) -> Broker:
        if self._broker is None:
            self._broker = Broker()   # $TOKENBROKER_SOCKET, else the system socket
        return self._broker

    def _token(self, service: str) -> Optional[str]:
        if not isinstance(service, str):
            raise TypeError("service must be a str")
        # What the broker cannot serve at all (empty, longer than the contract allows) is
        # served by nobody.
        if not service or len(service.encode("utf-8", "surrogatepass")) > MAX_URL:
            return None
        try:
            token = self.broker.credential(service).token
        except NotServed:
            return None
        except BrokerError as error:
            raise errors.KeyringError(f"tokenbroker: {error}") from error
        # A DPoP-bound token is good only with a proof for each request, which a password
        # cannot carry: not ours to hand out.
        if token.token_type.lower() == "dpop":
            return None
        return token.token

    def get_password(self, service: str, username: str) -> Optional[str]:
        return self._token(service)

    def get_credential(self, service: str, username: Optional[str]) -> Optional[credentials.SimpleCredential]:
        token = self._token(service)
        if token is None:
            return None
        return credentials.SimpleCredential(username or os.environ.get(USERNAME_VARIABLE) or DEFAULT_USERNAME, token)

    def set_password(self, service: str, username: str, password: str) -> None:
        raise BrokerOwnsCredentials("tokenbroker stores no passwords: the broker owns its sessions "
                                    "(log in with tokenbroker ctl login)")

    def delete_password(self, service: str, username: str) -> None:
        raise BrokerOwnsDeletion("tokenbroker deletes no passwords: the broker owns its sessions "
                                 "(log out with tokenbroker ctl logout)")


__all__ = ["TokenBrokerKeyring", "BrokerOwnsCredentials", "BrokerOwnsDeletion", "DEFAULT_USERNAME"]
