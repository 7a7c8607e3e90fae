import Fleet
import TokenBrokerCore
import Upstream

/// `Grant=refresh_token`: a refresh token obtained by a login (`Login`, the device flow),
/// rotated at each refresh. Waits signed out until someone logs in.
struct RefreshTokenGrant: OAuthSessionKind {
    let settings: SessionConfiguration.OAuthSettings

    var grant: RefreshTokenRequest { .refreshToken }

    var logsInAtStart: Bool { false }

    var interactiveLogin: InteractiveLoginOffer { .offered(settings) }

    func fleetRefusal(_ fleet: FleetSettings) -> String? {
        // A DPoP key is one host's: sharing it would put a private key in etcd, and a token
        // bound to it is useless to the other hosts' workers without it.
        guard settings.dpop == .off else {
            return "Fleet=yes cannot be used with DPoP=yes (a DPoP key never leaves its host; give each host a session of its own)"
        }
        // The flight's holder gives up its upstream request before its lease ends, leaving time
        // for one commit to etcd: a request that may take longer would be cut short every time.
        guard fleet.flightLease >= longestFlight + .seconds(5) + fleet.commitReserve else {
            return "[Fleet] FlightLease= (\(fleet.flightLease.seconds)s) must be at least the session's RequestTimeout= "
                + "(\(settings.client.timeout.seconds)s)\(settings.issuer == nil ? "" : ", plus its discovery deadline,") plus 5s, "
                + "plus [Fleet] RequestTimeout= for each endpoint (\(fleet.commitReserve.seconds)s)"
        }
        return nil
    }
}
