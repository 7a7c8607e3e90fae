import Varlink

/// Who may do what (guarantee 9), from the peer's credentials as the kernel reported them at
/// `connect()` (SO_PEERCRED, SO_PEERGROUPS).
///
/// - Admins: root, the daemon's own user (a process running as that user could read the
///   daemon's memory anyway), and members of `AdminGroup=`. They may call Login, Logout and
///   Reload and see every session.
/// - A session may be used by its `AllowUsers=` and by members (primary or supplementary) of its
///   `AllowGroups=`, and by admins. A session with neither list is for admins only.
struct Access: Sendable, Equatable {
    var daemonUID: UInt32
    var adminGroup: UInt32?

    func isAdmin(_ peer: PeerCredentials) -> Bool {
        peer.uid == 0 || peer.uid == daemonUID || adminGroup.map(peer.isMember(of:)) == true
    }

    func mayUse(_ session: SessionConfiguration, _ peer: PeerCredentials) -> Bool {
        isAdmin(peer) || session.allowUsers.contains(peer.uid) || session.allowGroups.contains(where: peer.isMember(of:))
    }
}
