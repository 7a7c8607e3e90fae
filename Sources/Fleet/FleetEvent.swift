/// What a fleet session tells the daemon's log, typed: the daemon picks the journal priority
/// from `level` and rate-limits by `limitKey`. Messages name positions, revisions and fields,
/// never a value.
public enum FleetEvent: Sendable, Equatable {
    case unavailable(String)
    case available
    /// A value that does not open, or opens at the wrong place in its key's history.
    /// `serving`: this broker has followed the fleet since it started, and serves the token it
    /// holds (if any); otherwise (restarted, or new) it serves nothing.
    case valueRefused(field: String, problem: String, revision: Int64, serving: Bool)
    /// The fleet's state is usable again after values were refused or history went back.
    case trusted(FleetPosition)
    /// The fleet shows a state older than this broker has applied or published (nil: none).
    case rolledBack(seen: FleetPosition?, floor: FleetPosition)
    /// Keys of an earlier version's layout, and none of this one.
    case earlierLayout
    case loggedIn(FleetPosition)
    case loggedOut(FleetPosition, endReason: String?)
    case loginNotApplied(String)
    case waitingForHolder(String)
    case published(login: Bool, FleetPosition)
    case logoutOvertaken(generation: FleetGeneration)
    /// This broker started the session's fleet history anew (an admin's reset), at this position.
    case historyStarted(FleetPosition)
    /// The fleet's state is in a later history than this broker had seen: someone started it
    /// anew (an admin's reset on another broker, or whoever holds the fleet key); followed.
    case newHistory(from: FleetPosition, to: FleetPosition)
    case lateAnswerDiscarded
    case overtakenByRefresh
    case commitFailed(String)
    /// The session's serial or generation reached its limit: it needs a new login (a serial), or
    /// its history started anew (a generation).
    case exhausted
    case pendingLogoutNotDurable(path: String)
    /// A refresh waiting for its commit could not be kept in the state database.
    case pendingCommitNotDurable(String)
    case pendingLogoutIgnored(path: String)
    /// Watches keep ending at once; restarts back off (the count so far).
    case watchEndingEarly(restarts: Int)

    public enum Level: Sendable, Equatable { case error, warning, notice, info }

    public var level: Level {
        switch self {
        case .valueRefused, .rolledBack, .earlierLayout, .loginNotApplied, .commitFailed, .exhausted, .pendingLogoutNotDurable,
             .pendingCommitNotDurable: return .error
        case .unavailable, .overtakenByRefresh, .pendingLogoutIgnored, .watchEndingEarly, .historyStarted, .newHistory: return .warning
        case .available, .trusted, .loggedOut, .logoutOvertaken, .lateAnswerDiscarded: return .notice
        case .loggedIn, .waitingForHolder, .published: return .info
        }
    }

    /// Events of one kind share a rate limit (nil: every one is logged).
    public var limitKey: String? {
        switch self {
        case let .valueRefused(field, _, _, _): return "fleet-refused-" + field
        case .rolledBack: return "fleet-rolled-back"
        case .watchEndingEarly: return "fleet-watch"
        default: return nil
        }
    }

    public var message: String {
        switch self {
        case let .unavailable(why):
            return "the fleet is unavailable: \(why); serving cached tokens, no refresh"
        case .available:
            return "the fleet is available again"
        case let .valueRefused(field, problem, revision, serving):
            return "the fleet's \(field) value written at etcd revision \(revision) \(problem); it is not taken "
                + "(written by someone without the fleet key?); "
                + (serving ? "serving the token this broker holds, if any, and refreshing nothing from it"
                           : "this broker has followed nothing of the fleet since it started, so it serves nothing for the session "
                             + "until a login moves the fleet on (tokenbroker ctl login)")
        case let .trusted(position):
            return "the fleet's state is trusted again (\(position))"
        case let .rolledBack(seen, floor):
            return "the fleet shows \(seen.map { "\($0)" } ?? "no state"), older than \(floor) that this broker has seen "
                + "(etcd restored from a backup, or written back by someone): not followed; log in again "
                + "(tokenbroker ctl login) to start a new generation after every broker's"
        case .earlierLayout:
            return "the fleet holds this session in the layout of an earlier version of tokenbroker; "
                + "log in again (tokenbroker ctl login) once every broker runs this version"
        case let .loggedIn(position):
            return "logged in from the fleet (fleet \(position))"
        case let .loggedOut(position, endReason):
            return (endReason.map { "ended in the fleet: \($0)" } ?? "logged out in the fleet") + " (fleet \(position))"
        case let .loginNotApplied(why):
            return "cannot apply the fleet's login: \(why)"
        case let .waitingForHolder(holder):
            return "\(holder) refreshes for the fleet; waiting for its result"
        case let .published(login, position):
            return "\(login ? "login" : "logout") published to the fleet (fleet \(position))"
        case let .logoutOvertaken(generation):
            return "the logout was overtaken in the fleet (fleet generation \(generation)); not published"
        case .lateAnswerDiscarded:
            return "a refresh answer arrived after a logout or login elsewhere; it is discarded"
        case .overtakenByRefresh:
            return "another broker committed a refresh first (this broker's flight had lapsed); this answer is dropped"
        case let .commitFailed(problem):
            return "the rotated refresh token could not be committed to the fleet (\(problem)); the next refresh will "
                + "present the spent one, and the issuer may refuse it as a replay: log in again if so"
        case .exhausted:
            return "the fleet's generation or token serial has reached its limit (2^53); log in again (tokenbroker ctl login) "
                + "if it is the serial; if it is the generation, start the session's fleet history anew "
                + "(tokenbroker ctl reset-fleet-history, an admin's call on any broker), then log in"
        case let .historyStarted(position):
            return "the session's fleet history was started anew here, by an admin (fleet \(position)): every broker "
                + "follows it as a logout, and positions of the earlier history are no longer compared; log in to go on"
        case let .newHistory(from, to):
            return "the fleet started the session's history anew (fleet \(to), after \(from) seen here): an admin's "
                + "reset on another broker, or whoever holds the fleet key; followed, and positions of the earlier history "
                + "are no longer compared"
        case let .pendingLogoutNotDurable(path):
            return "cannot remember the logout in \(path); it is kept in memory only"
        case let .pendingCommitNotDurable(why):
            return "cannot keep the refresh waiting for its commit in the state database (\(why)); it is kept in memory only, "
                + "and lost if this broker stops before etcd takes it"
        case let .pendingLogoutIgnored(path):
            return "\(path) does not name a logout under this fleet prefix; ignored"
        case let .watchEndingEarly(restarts):
            return "etcd ends the fleet's watch as soon as it starts (\(restarts) restarts so far); restarting with backoff"
        }
    }
}

/// What a fleet session counts (metrics and status).
public struct FleetCounters: Sendable, Equatable {
    /// Values read from etcd that were refused (each write counted once).
    public var refusedValues = 0
    /// Times the fleet showed older history than this broker had seen.
    public var rollbacks = 0
    /// Watches started again after one ended or failed.
    public var watchRestarts = 0

    public init() {}
}
