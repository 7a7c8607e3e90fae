"""tokenbroker: current OAuth 2.0 access tokens from the local broker, for Python workers."""

from .auth import BrokerAuth, Decision, HTTPXBrokerAuth, decide_with_proof, parse_challenges, should_retry
from .client import DEFAULT_SOCKET, Broker, Credential, Event, Proof, Token
from .errors import (BrokerError, ConfigurationError, ConnectionLost, InternalError, InvalidParameter, LifetimeTooShort, LoginFailed,
                     NoSuchSession, NotServed, PermissionDenied, ProtocolError, RefreshFailed, SessionConfigured, ShuttingDown,
                     SignedOut, StoreFailed, Throttled)

__all__ = ["Broker", "Token", "Proof", "Credential", "Event", "DEFAULT_SOCKET", "BrokerAuth", "HTTPXBrokerAuth", "parse_challenges",
           "should_retry", "decide_with_proof", "Decision",
           "BrokerError", "ConnectionLost", "NoSuchSession", "NotServed", "SignedOut", "PermissionDenied", "RefreshFailed", "Throttled", "LifetimeTooShort",
           "SessionConfigured", "StoreFailed", "ConfigurationError", "LoginFailed", "ShuttingDown", "InternalError",
           "ProtocolError", "InvalidParameter"]
