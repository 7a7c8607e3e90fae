/// The calendar time, in seconds since the Unix epoch.
///
/// The coordinator makes every decision on its monotonic `Clock`; the wall clock is read only to
/// turn a token lifetime into the `expiresAt` that the socket API reports and the store keeps, and
/// back when a stored session is loaded. Core has no access to the system time (it uses only the
/// standard library), so the daemon injects one.
public protocol WallClock: Sendable {
    /// Seconds since 1970-01-01T00:00:00Z.
    func unixTime() -> Double
}
