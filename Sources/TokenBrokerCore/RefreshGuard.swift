/// At most `limit` upstream requests per sliding `window`, on the monotonic time line.
///
/// Times are offsets from the coordinator's start (`Duration`), so the guard is pure.
public struct RefreshGuard: Sendable, Equatable {
    public let limit: Int
    public let window: Duration
    /// Start times of the requests inside the window, oldest first.
    private var starts: [Duration] = []

    public init(limit: Int, window: Duration) {
        self.limit = max(limit, 1)
        self.window = window
    }

    /// `nil` when a request may start at `now`, else how long until one may. `extra` requests
    /// are allowed on top of `limit` (the ones the tokens' lifetime makes necessary).
    public func retryAfter(now: Duration, allowing extra: Int = 0) -> Duration? {
        let live = starts.drop { $0 + window <= now }
        let allowed = limit + max(extra, 0)
        guard live.count >= allowed else { return nil }
        // The request that must leave the window before one more fits.
        return live[live.startIndex + (live.count - allowed)] + window - now
    }

    /// Requests started inside the window ending at `now`.
    public func count(now: Duration) -> Int {
        starts.count { $0 + window > now }
    }

    /// Records a request started at `now`. (At most `maximumKept` starts are kept: more could
    /// never be allowed, whatever the lifetime.)
    public mutating func record(now: Duration) {
        starts.removeAll { $0 + window <= now }
        starts.append(now)
        if starts.count > Self.maximumKept { starts.removeFirst(starts.count - Self.maximumKept) }
    }

    static let maximumKept = 110_000
}
