import Basics
import BrokerContract
import Synchronization
import TokenBrokerCore

/// The token files kept now: configured (`[Output]`, put as the configuration says at start and
/// at each reload) and those of delegations made with `ctl delegate --file` (for as long as
/// their delegation lasts).
///
/// Each file follows its session as a watcher does (`RefreshCoordinator.watch`): every new
/// token is written, a logout erases the file. Being watched, the session refreshes ahead of
/// expiry even when nobody asks (`Maintenance`), so the file is renewed `RefreshAhead=` before
/// its token expires; a token that expires all the same (the issuer unreachable) is erased
/// then, so a reader finds no file rather than a dead token. A session rebuilt at a reload is
/// followed anew; one no longer configured erases the file. All file work runs on one thread
/// of its own (made with the first file), never on the cooperative pool, one file at a time.
final class TokenFiles: Sendable {
    /// One file and the task that keeps it.
    private struct Entry: Sendable {
        let configuration: TokenFileConfiguration
        let configured: Bool
        let follower: Task<Void, Never>
        let status: FileStatus
    }

    /// What a file's follower last did (for `Delegations` and the metrics).
    final class FileStatus: Sendable {
        struct State: Sendable {
            /// The token in the file: its generation and serial (nil: no file).
            var written: (generation: Int, serial: UInt64)?
            /// Why the file cannot be kept now.
            var problem: String?
            /// Erases the file when its token expires with no new one (replaced at each write).
            var expiry: Task<Void, Never>?
        }

        /// Fired at the follower's first outcome: a token written, a write refused, nothing to
        /// write (the session signed out, or no token to be had).
        let settled = Latch()

        /// Sets the expiry task, cancelling the one before.
        func expire(with task: Task<Void, Never>?) {
            state.withLock { state in
                state.expiry?.cancel()
                state.expiry = task
            }
        }

        let state = Mutex(State())
    }

    private struct State {
        var entries: [String: Entry] = [:]
        var stopped = false
    }

    private let state = Mutex(State())
    private let table: SessionTable
    private let logger: Logger
    private let metrics: Metrics
    /// The file work, one job at a time (made with the first file).
    private let thread = Mutex<SerialThread?>(nil)
    private let changes = AsyncSerializer()

    /// Whether a name is taken elsewhere (by a delegation): a configured file does not take it.
    private let nameTaken = SynchronizedBox<@Sendable (String) -> Bool>({ _ in false })
    /// Where no token file may be: paths starting so (the state directory, the configuration
    /// file and its drop-in directory).
    let forbidden: [String]

    init(table: SessionTable, logger: Logger, metrics: Metrics, forbidden: [String] = []) {
        (self.table, self.logger, self.metrics) = (table, logger, metrics)
        self.forbidden = forbidden
    }

    /// Tells which names delegations hold (set once, by `Delegations`).
    func reserve(_ taken: @escaping @Sendable (String) -> Bool) { nameTaken.value = taken }

    /// Each file, in name order: its configuration, whether it is configured, and its problem.
    var all: [(configuration: TokenFileConfiguration, configured: Bool, problem: String?)] {
        state.withLock { Array($0.entries.values) }.sorted { $0.configuration.name < $1.configuration.name }
            .map { ($0.configuration, $0.configured, $0.status.state.withLock { $0.problem }) }
    }

    /// The problem of the file `name`, if it has one now.
    func problem(_ name: String) -> String? {
        state.withLock { $0.entries[name] }?.status.state.withLock { $0.problem }
    }

    /// Whether a file called `name` is kept.
    func contains(_ name: String) -> Bool { state.withLock { $0.entries[name] != nil } }

    enum Failure: Error, CustomStringConvertible {
        case exists(String)
        case path(String)
        case tooMany
        case stopped

        var description: String {
            switch self {
            case let .exists(name): return "a token file named \(name) exists already"
            case let .path(why): return why
            case .tooMany: return "there are \(TokenFileConfiguration.mostFiles) token files already"
            case .stopped: return "the daemon is stopping"
            }
        }
    }

    /// Starts keeping `file`. A file that could not be written now (an unsafe directory, a
    /// symlink at its path, an owner or ACL the daemon cannot give) is refused; else this
    /// returns once the first token is in it (or the follower found none to write, or could not
    /// write it: then the file is refused too), within `settling`.
    func add(_ file: TokenFileConfiguration, configured: Bool, settling: Duration = .seconds(10)) async throws(Failure) {
        let outcome: Result<FileStatus, Failure> = await changes.run { await self.addNow(file, configured: configured) }
        let status = try outcome.get()
        _ = await status.settled.wait(upTo: settling)
        if let problem = status.state.withLock({ $0.problem }) {
            await remove(file.name)
            throw .path(problem)
        }
    }

    /// Adds `file`. One that fails its check now is refused when made at run time; a configured
    /// one is kept all the same (its follower tries again at each new token, and says why it
    /// cannot meanwhile), and the failure returned.
    private func addNow(_ file: TokenFileConfiguration, configured: Bool) async -> Result<FileStatus, Failure> {
        if let place = forbidden.first(where: { file.path.hasPrefix($0) }) {
            return .failure(.path("\(file.path) is in \(place): the daemon's own files are never replaced by a token file"))
        }
        if configured, nameTaken.value(file.name) {
            return .failure(.exists(file.name))
        }
        let io = thread.withLock { thread in
            if thread == nil { thread = SerialThread() }
            return thread!
        }
        let check = try? await io.run { TokenFileWriter.check(file) }
        if let failure = check ?? nil, !configured { return .failure(.path("\(failure)")) }
        let status = FileStatus()
        if let failure = check ?? nil { status.state.withLock { $0.problem = "\(failure)" } }
        let added = state.withLock { state -> Result<FileStatus, Failure> in
            guard !state.stopped else { return .failure(.stopped) }
            if state.entries[file.name] != nil { return .failure(.exists(file.name)) }
            if state.entries.count >= TokenFileConfiguration.mostFiles { return .failure(.tooMany) }
            if let other = state.entries.values.first(where: { $0.configuration.path == file.path }) {
                return .failure(.path("\(file.path) is token file \(other.configuration.name)'s"))
            }
            // (Its only unstructured task: ended, and awaited, by `remove` or `stop`.)
            let follower = Task { await self.follow(file, status, io) }
            state.entries[file.name] = Entry(configuration: file, configured: configured, follower: follower, status: status)
            return .success(status)
        }
        if case .success = added, let failure = check ?? nil { return .failure(.path("\(failure)")) }
        return added
    }

    /// Stops keeping the file `name` and erases it; returns whether there was one.
    @discardableResult
    func remove(_ name: String) async -> Bool {
        await changes.run { await self.removeNow(name, erasing: true) }
    }

    private func removeNow(_ name: String, erasing: Bool) async -> Bool {
        guard let entry = state.withLock({ $0.entries.removeValue(forKey: name) }) else { return false }
        entry.follower.cancel()
        await entry.follower.value
        if erasing, let io = thread.withLock({ $0 }) {
            let path = entry.configuration.path
            let failure = try? await io.run { TokenFileWriter.erase(path) }
            if let failure = failure ?? nil { logger.warning("token file \(name): \(failure)") }
        }
        return true
    }

    /// Puts the configured files as `outputs` says (at start and at each reload): those gone or
    /// changed end (erased), new or changed ones start; a delegation's stay. Returns the problems.
    func reconcile(_ outputs: [TokenFileConfiguration]) async -> [String] {
        await changes.run {
            let current = self.state.withLock { $0.entries.values.filter(\.configured) }
            let wanted = Dictionary(outputs.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
            for entry in current where wanted[entry.configuration.name] != entry.configuration {
                _ = await self.removeNow(entry.configuration.name, erasing: true)
                self.logger.info("token file \(entry.configuration.name): \(wanted[entry.configuration.name] == nil ? "no longer configured" : "changed"); "
                                 + "\(entry.configuration.path) erased")
            }
            var problems: [String] = []
            for output in outputs {
                if let existing = self.state.withLock({ $0.entries[output.name] }) {
                    if !existing.configured {
                        let problem = "output \(output.name): a delegation made at run time has this name; undelegate it to keep the configured file"
                        problems.append(problem)
                        self.logger.error(problem)
                    }
                    continue
                }
                if case let .failure(failure) = await self.addNow(output, configured: true) as Result<FileStatus, Failure> {
                    problems.append("output \(output.name): \(failure)")
                    self.logger.error("output \(output.name): \(failure)")
                }
            }
            return problems
        }
    }

    /// Ends every follower (the daemon stops). The files stay: their tokens are still valid, and
    /// the next start takes them over (a session signed out by then erases its file).
    func stop() async {
        await changes.run {
            let entries = self.state.withLock { state -> [Entry] in
                state.stopped = true
                defer { state.entries.removeAll() }
                return Array(state.entries.values)
            }
            for entry in entries { entry.follower.cancel() }
            for entry in entries { await entry.follower.value }
        }
    }

    // MARK: - Following a session

    /// Keeps `file` as its session says, until cancelled: follows the session's coordinator, and
    /// the one that replaces it at a reload.
    private func follow(_ file: TokenFileConfiguration, _ status: FileStatus, _ io: SerialThread) async {
        defer { status.expire(with: nil) }
        while !Task.isCancelled {
            // Listen for changes first, then look: a change in between is not missed.
            let changes = table.changes()
            guard let session = table.snapshot.sessions[file.session] else {
                await erase(file, status, io, because: "session \(file.session) is not configured")
                status.settled.fire()
                for await _ in changes where table.snapshot.sessions[file.session] != nil { break }
                continue
            }
            let coordinator = session.coordinator
            // Until a reload replaces (or removes) the session's coordinator: its events may end
            // first (it retired), and are then waited out.
            await withTaskGroup(of: Bool.self) { group in
                group.addTask {
                    await self.track(coordinator, file, status, io)
                    return false
                }
                group.addTask {
                    for await _ in changes where self.table.snapshot.sessions[file.session]?.coordinator !== coordinator { return true }
                    return true
                }
                while let replaced = await group.next() {
                    if replaced { break }
                }
                group.cancelAll()
            }
        }
    }

    /// Writes each token `coordinator` hands out, erases the file at its logout (and at an
    /// expiry no new token came before), until its events end or the task is cancelled.
    private func track(_ coordinator: Coordinator, _ file: TokenFileConfiguration, _ status: FileStatus, _ io: SerialThread) async {
        let events = await coordinator.watch()
        if await coordinator.status().state == .active && coordinator.freshToken() == nil {
            // Active but without a usable token: fetch one, so the file starts with it. None to
            // be had (the issuer unreachable after a restart, say): what a file left from
            // before holds cannot be vouched for, and goes.
            do {
                _ = try await coordinator.token()
            } catch {
                await erase(file, status, io, because: "no token to be had: \(error)")
                status.settled.fire()
            }
        }
        for await event in events {
            guard !Task.isCancelled else { return }
            switch event {
            case let .token(token):
                let current = status.state.withLock { $0.written }
                if let current, current.generation == token.generation, current.serial == token.serial { continue }
                status.expire(with: nil)
                guard await write(token, file, status, io) else { continue }
                if let expiresAt = token.expiresAt {
                    // (Replaced at each write, cancelled when the follower ends.)
                    status.expire(with: Task {
                        try? await Task.sleep(for: .seconds(max(expiresAt - UTCTime.unixSeconds(), 0)))
                        guard !Task.isCancelled else { return }
                        await self.erase(file, status, io, because: "its token \(token.serial) expired before a new one came",
                                         holding: (token.generation, token.serial))
                    })
                }
            case .signedOut:
                status.expire(with: nil)
                await erase(file, status, io, because: "session \(file.session) signed out")
            }
            status.settled.fire()
        }
    }

    /// Writes `token` to the file; returns whether it is there now. (What the file holds is
    /// recorded on the file thread, in the same job as the write: an erase that checks it there
    /// sees every write before it.)
    private func write(_ token: IssuedToken, _ file: TokenFileConfiguration, _ status: FileStatus, _ io: SerialThread) async -> Bool {
        let result: Result<Bool, TokenFileWriter.Failure>? = try? await io.run {
            // (Made here, and zeroed here: the only copy of the file's bytes.)
            guard var bytes = TokenFileWriter.content(token, file.format) else {
                return .failure(.unwritable("token \(token.serial) holds characters a token file cannot carry"))
            }
            defer { for index in bytes.indices { bytes[index] = 0 } }
            do throws(TokenFileWriter.Failure) {
                _ = try TokenFileWriter.write(bytes, file)
                return .success(status.state.withLock { state -> Bool in
                    state.written = (token.generation, token.serial)
                    defer { state.problem = nil }
                    return state.problem != nil
                })
            } catch {
                return .failure(error)
            }
        }
        switch result {
        case let .success(recovered)?:
            metrics.tokenFileWrite(failed: false)
            if recovered { logger.notice("token file \(file.name): \(file.path) written again", session: file.session) }
            audit(token, file)
            return true
        case let .failure(failure)?:
            metrics.tokenFileWrite(failed: true)
            report(file, status, "\(failure)")
            // (What was there is not this session's current token: gone with the reason.)
            await erase(file, status, io, because: nil)
            return false
        case nil:
            return false
        }
    }

    /// Erases the file and says why (when it held a token). With `holding`, only while the file
    /// still holds that token (checked on the file thread, after every write before it).
    private func erase(_ file: TokenFileConfiguration, _ status: FileStatus, _ io: SerialThread, because why: String?,
                       holding: (generation: Int, serial: UInt64)? = nil) async {
        let path = file.path
        let outcome: (had: Bool, failure: TokenFileWriter.Failure?)? = try? await io.run {
            let had = status.state.withLock { state -> Bool? in
                if let holding, state.written?.generation != holding.generation || state.written?.serial != holding.serial { return nil }
                defer { state.written = nil }
                return state.written != nil
            }
            guard let had else { return (false, nil) }
            return (had, TokenFileWriter.erase(path))
        }
        guard let outcome else { return }
        switch outcome.failure {
        case nil:
            if outcome.had, let why { logger.info("token file \(file.name): \(file.path) erased: \(why)", session: file.session) }
        case .notAFile?:
            break   // (not the broker's: left alone, as the write that found it said)
        case let failure?:
            report(file, status, "cannot erase it: \(failure)")
        }
    }

    /// A token written to a file is handed out too: an audit entry names the file, its owner
    /// and readers (never the token). Once per token and file.
    private func audit(_ token: IssuedToken, _ file: TokenFileConfiguration) {
        let readers = file.readers.map(String.init).joined(separator: " ")
        let line = "audit: token #\(token.serial) of session \(file.session) (generation \(token.generation)) written to \(file.path) "
            + "(token file \(file.name)" + (readers.isEmpty ? "" : ", readers \(readers)") + ")"
        var fields = ["MESSAGE=\(line)", "MESSAGE_ID=\(Audit.messageID)", "PRIORITY=6", "SYSLOG_IDENTIFIER=tokenbroker",
                      "SESSION=\(file.session)", "GENERATION=\(token.generation)", "TOKEN_SERIAL=\(token.serial)", "METHOD=File",
                      "FILE=\(file.path)", "OUTPUT=\(file.name)"]
        if !readers.isEmpty { fields.append("READERS=\(readers)") }
        logger.audit(fields, line: line)
    }

    private func report(_ file: TokenFileConfiguration, _ status: FileStatus, _ problem: String) {
        let changed = status.state.withLock { state -> Bool in
            defer { state.problem = problem }
            return state.problem != problem
        }
        if changed { logger.error("token file \(file.name): \(problem)", session: file.session) }
    }
}
