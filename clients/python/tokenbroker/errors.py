"""The contract's errors as exceptions. Their messages never hold a token."""

from typing import Any, Dict, Optional


class BrokerError(Exception):
    """An error the broker answered with (its varlink error name in `name`)."""

    name = "io.tokenbroker.Broker.Error"

    def __init__(self, message: str = "", parameters: Optional[Dict[str, Any]] = None):
        super().__init__(message or self.name)
        self.parameters = parameters or {}
        self.session = self.parameters.get("session")


class ConnectionLost(BrokerError):
    """The broker could not be reached, closed the connection, or did not answer in time
    (`timed_out`)."""

    name = "tokenbroker.ConnectionLost"

    def __init__(self, message: str = "", parameters: Optional[Dict[str, Any]] = None, timed_out: bool = False):
        super().__init__(message, parameters)
        self.timed_out = timed_out


class NoSuchSession(BrokerError):
    name = "io.tokenbroker.Broker.NoSuchSession"


class NotServed(NoSuchSession):
    """Credential: no session this caller may use serves the URL (the broker's NoSuchSession
    with an empty session; it says the same whether nobody serves it or another user's session
    does)."""


class SignedOut(BrokerError):
    name = "io.tokenbroker.Broker.SignedOut"


class PermissionDenied(BrokerError):
    name = "io.tokenbroker.Broker.PermissionDenied"


class RefreshFailed(BrokerError):
    """The shared refresh failed. `retryable` says whether trying later may help; `retry_after`
    (seconds) when."""

    name = "io.tokenbroker.Broker.RefreshFailed"

    def __init__(self, message: str = "", parameters: Optional[Dict[str, Any]] = None):
        super().__init__(message, parameters)
        self.reason = self.parameters.get("reason", "")
        self.retryable = bool(self.parameters.get("retryable", False))
        self.retry_after = self.parameters.get("retryAfter")


class Throttled(BrokerError):
    name = "io.tokenbroker.Broker.Throttled"

    def __init__(self, message: str = "", parameters: Optional[Dict[str, Any]] = None):
        super().__init__(message, parameters)
        self.retry_after = self.parameters.get("retryAfter")


class LifetimeTooShort(BrokerError):
    """A token valid for `min_valid` seconds was asked for, but the issuer's tokens live only
    `lifetime` seconds: no refresh would give one."""

    name = "io.tokenbroker.Broker.LifetimeTooShort"

    def __init__(self, message: str = "", parameters: Optional[Dict[str, Any]] = None):
        super().__init__(message, parameters)
        self.lifetime = self.parameters.get("lifetime")
        self.min_valid = self.parameters.get("minValid")


class SessionConfigured(BrokerError):
    name = "io.tokenbroker.Broker.SessionConfigured"


class StoreFailed(BrokerError):
    name = "io.tokenbroker.Broker.StoreFailed"


class ConfigurationError(BrokerError):
    name = "io.tokenbroker.Broker.ConfigurationError"


class LoginFailed(BrokerError):
    name = "io.tokenbroker.Broker.LoginFailed"


class ShuttingDown(BrokerError):
    name = "io.tokenbroker.Broker.ShuttingDown"


class InternalError(BrokerError):
    name = "io.tokenbroker.Broker.InternalError"


class ProtocolError(BrokerError):
    name = "io.tokenbroker.Broker.ProtocolError"


class InvalidParameter(BrokerError, ValueError):
    """The broker refused a call's parameter (varlink's own error): `parameter` names it, e.g.
    GetProof's `method` or `uri`. A ValueError too."""

    name = "org.varlink.service.InvalidParameter"

    def __init__(self, message: str = "", parameters: Optional[Dict[str, Any]] = None):
        super().__init__(message, parameters)
        self.parameter = self.parameters.get("parameter", "")


_BY_NAME = {cls.name: cls for cls in (NoSuchSession, SignedOut, PermissionDenied, RefreshFailed, Throttled, LifetimeTooShort, SessionConfigured,
                                      StoreFailed, ConfigurationError, LoginFailed, ShuttingDown, InternalError, ProtocolError,
                                      InvalidParameter)}


def error_from_reply(name: str, parameters: Dict[str, Any]) -> BrokerError:
    cls = _BY_NAME.get(name, BrokerError)
    detail = parameters.get("reason") or parameters.get("session") or parameters.get("parameter") or ""
    message = f"{name.rsplit('.', 1)[-1]}" + (f": {detail}" if detail else "")
    error = cls(message, parameters)
    if cls is BrokerError:
        error.name = name
    return error
