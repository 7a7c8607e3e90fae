import BrokerContract
import Synchronization
import TokenBrokerCore

/// The keys callers narrow a session's token to, call by call (`resource`, `scope` on GetToken
/// and Recover): each a derived session of its own, made at its first call — its own token,
/// one flight, refresh guard — kept in memory only (derived anew after a restart), at most
/// `MaxKeys=`, the least recently used dropped first. What a key may be is the session's
/// `AllowResources=` and `AllowScopes=`; a key outside them is refused as one that does not exist.
final class DerivedKeys: Sendable {
    private struct State {
        var entries: [TokenKey: (session: SessionTable.Session, lastUse: UInt64)] = [:]
        var tick: UInt64 = 0
        var serial = 0
        var evicted = 0
    }

    private let state = Mutex(State())
    let limit: Int
    let allowResources: Set<String>
    let allowScopes: Set<String>
    /// Makes the session of a key (its coordinator active, nothing fetched), named by `serial`.
    private let make: @Sendable (TokenKey, Int) -> SessionTable.Session
    /// Retires what is dropped (evicted, or ended with the parent's generation).
    private let retire: @Sendable ([SessionTable.Session]) -> Void

    init(limit: Int, allowResources: [String], allowScopes: [String], make: @escaping @Sendable (TokenKey, Int) -> SessionTable.Session,
         retire: @escaping @Sendable ([SessionTable.Session]) -> Void) {
        self.limit = limit
        self.allowResources = Set(allowResources)
        self.allowScopes = Set(allowScopes)
        self.make = make
        self.retire = retire
    }

    /// Whether callers may ask for `key`.
    func allows(_ key: TokenKey) -> Bool {
        if let resource = key.resource, !allowResources.contains(resource) { return false }
        return key.scopeWords.isSubset(of: allowScopes)
    }

    /// The session of `key`, made now if there is none (dropping the least recently used
    /// beyond the limit); nil when callers may not ask for it.
    func session(for key: TokenKey) -> SessionTable.Session? {
        guard allows(key) else { return nil }
        var dropped: SessionTable.Session?
        let session = state.withLock { state -> SessionTable.Session in
            state.tick &+= 1
            if let entry = state.entries[key] {
                state.entries[key]?.lastUse = state.tick
                return entry.session
            }
            if state.entries.count >= limit, let oldest = state.entries.min(by: { $0.value.lastUse < $1.value.lastUse }) {
                state.entries[oldest.key] = nil
                state.evicted += 1
                dropped = oldest.value.session
            }
            state.serial += 1
            let made = make(key, state.serial)
            state.entries[key] = (made, state.tick)
            return made
        }
        if let dropped { retire([dropped]) }
        return session
    }

    /// Drops every key (the parent's generation ended): their callers get SignedOut.
    func dropAll() {
        let all = state.withLock { state -> [SessionTable.Session] in
            defer { state.entries.removeAll() }
            return state.entries.values.map(\.session)
        }
        if !all.isEmpty { retire(all) }
    }

    /// Keys held now, and dropped to stay within the limit so far.
    var counts: (live: Int, evicted: Int) { state.withLock { ($0.entries.count, $0.evicted) } }
}
