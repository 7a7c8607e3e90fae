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

    /// `nil` when a request may start at `now`, else how long until one may.
    public func retryAfter(now: Duration) -> Duration? {
        let live = starts.drop { $0 + window <= now }
        guard live.count >= limit, let oldest = live.first else { return nil }
        return oldest + window - now
    }

    /// Requests started inside the window ending at `now`.
    public func count(now: Duration) -> Int {
        starts.count { $0 + window > now }
    }

    /// Records a request started at `now`.
    public mutating func record(now: Duration) {
        starts.removeAll { $0 + window <= now }
        starts.append(now)
    }
}
