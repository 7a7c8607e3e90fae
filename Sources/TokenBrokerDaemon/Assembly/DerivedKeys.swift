import BrokerContract
import Synchronization
import TokenBrokerCore

/// The keys callers narrow a session's token to, call by call (`resource`, `scope` on GetToken
/// and Recover): each a derived session of its own, made at its first call — its own token,
/// one flight, refresh guard — kept in memory only (derived anew after a restart), at most
/// `MaxKeys=`, the least recently used dropped first. What a key may be is the session's
/// `AllowResources=` and `AllowScopes=`; a key outside them is refused as one that does not
/// exist. New keys are made at most `MaxKeys=` (or the refresh guard's burst, if larger) per
/// `RefreshLimitInterval=`: a caller cycling through keys costs the issuer that many exchanges
/// at most, then gets `Throttled`. One uid makes at most its share of them (half,
/// `RefreshBudget.share`): a hog cycling through keys is throttled before the others are.
final class DerivedKeys: Sendable {
    private struct State {
        var entries: [TokenKey: (session: SessionTable.Session, lastUse: UInt64)] = [:]
        var tick: UInt64 = 0
        var serial = 0
        var evicted = 0
        /// When keys were made lately (monotonic), and for whom, for the creation budget.
        var made: [(at: ContinuousClock.Instant, uid: UInt32)] = []
    }

    private let state = Mutex(State())
    let limit: Int
    let allowResources: Set<String>
    let allowScopes: Set<String>
    /// How many keys may be made per `window`, and by one uid.
    let creations: Int
    let share: Int
    let window: Duration
    /// Makes the session of a key (its coordinator active, nothing fetched), named by `serial`.
    private let make: @Sendable (TokenKey, Int) -> SessionTable.Session
    /// Stops what is no longer reachable (its logout awaited first where a boundary needs it).
    private let stop: @Sendable ([SessionTable.Session]) -> Void

    init(limit: Int, allowResources: [String], allowScopes: [String], creations: Int, window: Duration,
         make: @escaping @Sendable (TokenKey, Int) -> SessionTable.Session, stop: @escaping @Sendable ([SessionTable.Session]) -> Void) {
        self.limit = limit
        self.allowResources = Set(allowResources)
        self.allowScopes = Set(allowScopes)
        self.creations = creations
        share = RefreshBudget.share(of: creations)
        self.window = window
        self.make = make
        self.stop = stop
    }

    /// Why callers may not ask for `key` (the parameter to name), or nil when they may.
    func refusal(_ key: TokenKey) -> String? {
        if let resource = key.resource, !allowResources.contains(resource) { return "resource" }
        return key.scopeWords.allSatisfy({ allowScopes.contains(String($0)) }) ? nil : "scope"
    }

    /// The session of `key` if it has been made (the hot path: one lookup under the lock).
    func existing(_ key: TokenKey) -> SessionTable.Session? {
        state.withLock { state in
            guard let index = state.entries.index(forKey: key) else { return nil }
            state.tick &+= 1
            state.entries.values[index].lastUse = state.tick
            return state.entries.values[index].session
        }
    }

    enum Made {
        case session(SessionTable.Session)
        /// The creation budget is spent: try again after this.
        case throttled(Duration)
    }

    /// The session of an allowed `key`, made now if there is none (dropping the least recently
    /// used beyond the limit), within the creation budget and `uid`'s share of it.
    func session(for key: TokenKey, by uid: UInt32) -> Made {
        if let found = existing(key) { return .session(found) }
        let now = ContinuousClock.now
        let made = state.withLock { state -> (serial: Int?, retryAfter: Duration) in
            state.made.removeAll { $0.at.duration(to: now) >= window }
            let own = state.made.filter { $0.uid == uid }
            guard state.made.count < creations, own.count < share else {
                // Until the oldest creation that stands in the way leaves the window.
                let oldest = (own.count >= share ? own.first : state.made.first)?.at ?? now
                return (nil, max(window - oldest.duration(to: now), .seconds(1)))
            }
            state.made.append((now, uid))
            state.serial += 1
            return (state.serial, .zero)
        }
        guard let serial = made.serial else { return .throttled(made.retryAfter) }
        // Made outside the lock (a coordinator, its HTTP source, a journal line); another caller
        // may have made the same key meanwhile: the first one in is kept.
        let fresh = make(key, serial)
        var unused: [SessionTable.Session] = []
        let session = state.withLock { state -> SessionTable.Session in
            state.tick &+= 1
            if let entry = state.entries[key] {
                unused.append(fresh)
                return entry.session
            }
            if state.entries.count >= limit, let oldest = state.entries.min(by: { $0.value.lastUse < $1.value.lastUse }) {
                state.entries[oldest.key] = nil
                state.evicted += 1
                unused.append(oldest.value.session)
            }
            state.entries[key] = (fresh, state.tick)
            return fresh
        }
        // (An evicted key's token was derived in the current generation: no boundary is owed.)
        if !unused.isEmpty { stop(unused) }
        return .session(session)
    }

    /// Ends every key (the session's generation ended, or it leaves at a reload): each signed
    /// out before this returns — a flight under way installs nothing, its callers get
    /// SignedOut — then stopped.
    func endAll() async {
        let all = state.withLock { state -> [SessionTable.Session] in
            defer { state.entries.removeAll() }
            return state.entries.values.map(\.session)
        }
        guard !all.isEmpty else { return }
        await withTaskGroup(of: Void.self) { group in
            for key in all { group.addTask { try? await key.coordinator.logout() } }
        }
        stop(all)
    }

    /// Keys held now, and dropped to stay within the limit so far.
    var counts: (live: Int, evicted: Int) { state.withLock { ($0.entries.count, $0.evicted) } }
}
