import TokenBrokerCore
import Varlink

/// Who may do what (guarantee 9), from the peer's credentials as the kernel reported them at
/// `connect()` (SO_PEERCRED, SO_PEERGROUPS).
///
/// - Admins: root, the daemon's own user (a process running as that user could read the
///   daemon's memory anyway), and members of `AdminGroup=`. They may call Login, Logout and
///   Reload and see every session.
/// - A session may be used by its `AllowUsers=` and by members (primary or supplementary) of its
///   `AllowGroups=`, and by admins. A session with neither list is for admins only.
/// - Through a delegation's socket (`PeerCredentials.listener` not 0) nobody is an admin and
///   no session is usable by these rules: the delegation says which of its sessions are.
/// - The overflow ids (65534) never match anything, not even a daemon running as that user:
///   the kernel reports them for any peer whose id has no mapping in the daemon's user
///   namespace, so they name nobody in particular.
struct Access: Sendable, Equatable {
    var daemonUID: UInt32
    var adminGroup: UInt32?
    var overflowUID = ProcessDefences.overflowUID
    var overflowGID = ProcessDefences.overflowGID

    func isAdmin(_ peer: PeerCredentials) -> Bool {
        // Through a delegation's socket nobody is an admin (the delegation is the principal).
        guard peer.uid != overflowUID, peer.listener == 0 else { return false }
        return peer.uid == 0 || peer.uid == daemonUID || adminGroup.map { isMember(peer, of: $0) } == true
    }

    func mayUse(_ session: SessionConfiguration, _ peer: PeerCredentials) -> Bool {
        mayUse(allowUsers: session.allowUsers, allowGroups: session.allowGroups, peer)
    }

    func mayUse(allowUsers: [UInt32], allowGroups: [UInt32], _ peer: PeerCredentials) -> Bool {
        // (A delegation's peers use its sessions, which it names: `Delegations.Grant`.)
        guard peer.listener == 0 else { return false }
        return isAdmin(peer)
            || (peer.uid != overflowUID && allowUsers.contains(peer.uid))
            || allowGroups.contains { isMember(peer, of: $0) }
    }

    /// Whether `peer` is in group `gid` (primary or supplementary); the overflow gid never is.
    func isMember(_ peer: PeerCredentials, of gid: UInt32) -> Bool {
        gid != overflowGID && peer.isMember(of: gid)
    }
}

extension PeerCredentials {
    /// Who a refresh this peer's demand starts is charged to (`RefreshBudget`).
    /// Through a delegation, the delegation: all its peers share one share, whatever uids they take.
    var demander: Demander { Demander(uid: uid, delegation: listener) }
}
