#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import Synchronization
import Varlink

/// The delegations served now: configured (`[Delegation]`, put as the configuration says at
/// start and at each reload) and made at run time (`Delegate`, until `Undelegate`, their ttl or
/// the daemon's stop). Each is a socket of its own on the varlink server's one loop
/// (`VarlinkServer.addListener`): its peers carry its listener id, by which every call of theirs
/// finds its grant here (one lookup under a lock), and with it the only sessions it may name.
/// One made at run time may keep a token file instead or as well (`TokenFiles`), which ends
/// (erased) with it.
final class Delegations: Sendable {
    /// What a delegation's socket may do.
    struct Grant: Sendable {
        let id: UInt32
        let configuration: DelegationConfiguration
        let sessions: Set<String>
        let configured: Bool
        /// The socket file it bound (removed at its end only if it is still that file); nil:
        /// it has no socket.
        let inode: ino_t?

        var name: String { configuration.name }

        /// Whether `peer` (connected through its socket) may use it: anyone who can open the
        /// socket, or only its `AllowUsers=`/`AllowGroups=` where it names some.
        func admits(_ peer: PeerCredentials, overflowUID: UInt32, overflowGID: UInt32) -> Bool {
            let (users, groups) = (configuration.allowUsers, configuration.allowGroups)
            guard !users.isEmpty || !groups.isEmpty else { return true }
            return (peer.uid != overflowUID && users.contains(peer.uid))
                || groups.contains { $0 != overflowGID && peer.isMember(of: $0) }
        }

        func info(problem: String?) -> DelegationInfo {
            DelegationInfo(name: name, sessions: configuration.sessions, socket: configuration.socket.isEmpty ? nil : configuration.socket,
                           file: configuration.file?.path, expiresAt: configuration.expiresAt, configured: configured, problem: problem)
        }
    }

    private struct State {
        var byListener: [UInt32: Grant] = [:]
        var byName: [String: UInt32] = [:]
        var nextID: UInt32 = 1
        /// The expiry of each delegation that has one.
        var timers: [UInt32: Task<Void, Never>] = [:]
        var server: VarlinkServer?
        var stopped = false
    }

    private let state = Mutex(State())
    private let logger: Logger
    /// The token files, a delegation's among them.
    let files: TokenFiles?
    /// Changes one after another (a reload's and an admin's never interleave).
    private let changes = AsyncSerializer()

    init(logger: Logger, files: TokenFiles? = nil) {
        self.logger = logger
        self.files = files
        // A configured file does not take a delegation's name.
        files?.reserve { [weak self] name in self?.has(name) ?? false }
    }

    /// Whether a delegation called `name` is served now.
    func has(_ name: String) -> Bool { state.withLock { $0.byName[name] != nil } }

    /// The server whose loop serves the delegations' sockets (set once it exists).
    func attach(_ server: VarlinkServer) {
        state.withLock { $0.server = server }
    }

    /// The grant of the listener a peer came through (nil: none now; it was removed).
    func grant(forListener id: UInt32) -> Grant? {
        state.withLock { $0.byListener[id] }
    }

    /// Every delegation, in name order.
    var all: [Grant] {
        state.withLock { Array($0.byListener.values) }.sorted { $0.name < $1.name }
    }

    /// Every delegation and configured token file, as `Delegations` lists them, in name order.
    var infos: [DelegationInfo] {
        let delegations = all.map { $0.info(problem: $0.configuration.file == nil ? nil : files?.problem($0.name)) }
        let outputs = (files?.all ?? []).filter(\.configured).map { file in
            DelegationInfo(name: file.configuration.name, sessions: [file.configuration.session], socket: nil, file: file.configuration.path,
                           expiresAt: nil, configured: true, problem: file.problem)
        }
        return (delegations + outputs).sorted { $0.name < $1.name }
    }

    enum Failure: Error, CustomStringConvertible {
        case exists(String)
        case tooMany
        case socket(String)
        case file(String)
        case stopped

        var description: String {
            switch self {
            case let .exists(name): return "a delegation or token file named \(name) exists already"
            case .tooMany: return "there are \(DelegationConfiguration.mostDelegations) delegations already"
            case let .socket(why): return why
            case let .file(why): return "file: \(why)"
            case .stopped: return "the daemon is stopping"
            }
        }
    }

    /// Serves `configuration` on its socket (bound now, as the broker's own is: in a directory
    /// only root or the daemon's user can change, a stale socket replaced, never another file).
    @discardableResult
    func add(_ configuration: DelegationConfiguration, configured: Bool) async throws(Failure) -> Grant {
        let outcome: Result<Grant, Failure> = await changes.run { await self.addNow(configuration, configured: configured) }
        return try outcome.get()
    }

    private func addNow(_ configuration: DelegationConfiguration, configured: Bool) async -> Result<Grant, Failure> {
        let files = self.files
        let reserved = state.withLock { state -> Result<(UInt32, VarlinkServer), Failure> in
            guard !state.stopped, let server = state.server else { return .failure(.stopped) }
            if state.byName[configuration.name] != nil || files?.contains(configuration.name) == true { return .failure(.exists(configuration.name)) }
            if state.byListener.count >= DelegationConfiguration.mostDelegations { return .failure(.tooMany) }
            if !configuration.socket.isEmpty, let other = state.byListener.values.first(where: { $0.configuration.socket == configuration.socket }) {
                return .failure(.socket("\(configuration.socket) is delegation \(other.name)'s socket"))
            }
            // An id no live delegation has (ids wrap after 2^32 delegations).
            while state.byListener[state.nextID] != nil { state.nextID = state.nextID == UInt32.max ? 1 : state.nextID + 1 }
            let id = state.nextID
            state.nextID = id == UInt32.max ? 1 : id + 1
            return .success((id, server))
        }
        let id: UInt32, server: VarlinkServer
        switch reserved {
        case let .success(value): (id, server) = value
        case let .failure(failure): return .failure(failure)
        }
        var bound: (fd: Int32, inode: ino_t)?
        if !configuration.socket.isEmpty {
            do {
                bound = try SocketPath.bind(configuration.socket, mode: configuration.socketMode, group: configuration.socketGroup,
                                            owner: configuration.socketUser)
            } catch {
                return .failure(.socket("\(error)"))
            }
        }
        // The grant first: a peer that connects the moment the socket serves finds it.
        let grant = Grant(id: id, configuration: configuration, sessions: Set(configuration.sessions), configured: configured, inode: bound?.inode)
        state.withLock { state in
            state.byListener[id] = grant
            state.byName[configuration.name] = id
        }
        func undo() {
            state.withLock { state in
                state.byListener[id] = nil
                state.byName[configuration.name] = nil
            }
            if let bound { SocketPath.remove(configuration.socket, inode: bound.inode) }
        }
        if let bound {
            do {
                try server.addListener(bound.fd, id: id, maximumConnections: configuration.maxConnections)
            } catch {
                undo()
                return .failure(.socket("\(error)"))
            }
        }
        if let file = configuration.file {
            do {
                guard let files else { throw TokenFiles.Failure.stopped }
                try await files.add(file, configured: false)
            } catch {
                if bound != nil { await server.removeListener(id: id) }
                undo()
                return .failure(.file("\(error)"))
            }
        }
        let timer = configuration.expiresAt.map { expiresAt in
            Task { [weak self] in
                let left = max(expiresAt - UTCTime.unixSeconds(), 0)
                try? await Task.sleep(for: .seconds(left))
                guard !Task.isCancelled, let self else { return }
                if await self.remove(configuration.name, only: id) {
                    self.logger.notice("delegation \(configuration.name) expired: "
                                       + (configuration.socket.isEmpty ? "its file is erased" : "its socket \(configuration.socket) is closed"))
                }
            }
        }
        if let timer { state.withLock { $0.timers[id] = timer } }
        let faces = [configuration.socket.isEmpty ? nil : "on \(configuration.socket)", configuration.file.map { "in file \($0.path)" }]
        logger.notice("delegation \(configuration.name): sessions \(configuration.sessions.joined(separator: " ")) "
                      + faces.compactMap { $0 }.joined(separator: " and ") + (configuration.expiresAt.map { ", until \(UTCTime.timestamp($0))" } ?? ""))
        return .success(grant)
    }

    /// Ends the delegation `name` (only if it is still listener `only`, when given): its
    /// socket file removed and every connection through it closed before this returns.
    /// Returns whether there was one.
    @discardableResult
    func remove(_ name: String, only: UInt32? = nil) async -> Bool {
        await changes.run { await self.removeNow(name, only: only) }
    }

    private func removeNow(_ name: String, only: UInt32?) async -> Bool {
        let taken = state.withLock { state -> (Grant, Task<Void, Never>?, VarlinkServer?)? in
            guard let id = state.byName[name], only == nil || only == id, let grant = state.byListener.removeValue(forKey: id) else { return nil }
            state.byName[name] = nil
            return (grant, state.timers.removeValue(forKey: id), state.server)
        }
        guard let (grant, timer, server) = taken else { return false }
        // (The expiry's own task removing it: cancelling itself changes nothing.)
        timer?.cancel()
        if let inode = grant.inode {
            SocketPath.remove(grant.configuration.socket, inode: inode)
            await server?.removeListener(id: grant.id)
        }
        if grant.configuration.file != nil { await files?.remove(grant.name) }
        return true
    }

    /// Before a reload's sessions change: ends the configured delegations that are gone or
    /// changed, and those made at run time that name a session no longer configured (a session
    /// added later under that name is not theirs), so that none serves the new sessions under
    /// its old grant. `reconcile` then starts the new ones.
    func narrow(to configured: [DelegationConfiguration], sessions names: @escaping @Sendable () -> Set<String>) async {
        await changes.run {
            let wanted = Dictionary(configured.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
            let current = self.state.withLock { Array($0.byListener.values) }
            // (The set of every session's name only when a delegation made at run time needs it.)
            let sessions = current.contains { !$0.configured } ? names() : []
            for grant in current {
                let ends = grant.configured ? wanted[grant.name] != grant.configuration : !grant.sessions.isSubset(of: sessions)
                guard ends else { continue }
                _ = await self.removeNow(grant.name, only: grant.id)
                self.logger.info("delegation \(grant.name): "
                                 + (grant.configured ? (wanted[grant.name] == nil ? "no longer configured" : "changed")
                                                     : "a session it serves is no longer configured") + "; its socket is closed")
            }
        }
    }

    /// Puts the configured delegations as `configured` says (at start and at each reload):
    /// those gone or changed end, new or changed ones start; the ones made at run time stay.
    /// Returns the problems (one per delegation that could not be served).
    func reconcile(_ configured: [DelegationConfiguration]) async -> [String] {
        await changes.run { await self.reconcileNow(configured) }
    }

    private func reconcileNow(_ configured: [DelegationConfiguration]) async -> [String] {
        let current = state.withLock { state in state.byListener.values.filter(\.configured) }
        let wanted = Dictionary(configured.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
        for grant in current where wanted[grant.name] != grant.configuration {
            _ = await removeNow(grant.name, only: grant.id)
            logger.info("delegation \(grant.name): \(wanted[grant.name] == nil ? "no longer configured" : "changed"); its socket is closed")
        }
        var problems: [String] = []
        for delegation in configured {
            if state.withLock({ $0.byName[delegation.name] != nil }) {
                // The same, configured, or one made at run time under that name: that one stays.
                if let id = state.withLock({ $0.byName[delegation.name] }), state.withLock({ $0.byListener[id]?.configured }) == false {
                    problems.append("delegation \(delegation.name): a delegation made at run time has this name; undelegate it to serve the configured one")
                }
                continue
            }
            if case let .failure(failure) = await addNow(delegation, configured: true) {
                problems.append("delegation \(delegation.name): \(failure)")
            }
        }
        for problem in problems { logger.error(problem) }
        return problems
    }

    /// Ends every delegation (the daemon stops): their socket files removed; their connections
    /// end with the server.
    func stop() async {
        await changes.run {
            let names = self.state.withLock { state -> [String] in
                state.stopped = true
                return Array(state.byName.keys)
            }
            for name in names { _ = await self.removeNow(name, only: nil) }
        }
    }
}
