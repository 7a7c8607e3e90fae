import TokenBrokerCore
import WireJSON

/// Numbers from an authorization server (JSON members, headers) as durations. Whatever the
/// server sends — 1e300, -5, "NaN", a string of digits — the result is a duration in range or
/// nothing: never a trap converting to a fixed-width integer.
enum UpstreamNumbers {
    /// `value` seconds (a JSON number, or a string holding one, as some servers send), capped at
    /// `maximum`; `nil` when it is absent, not a finite number, or not above zero.
    static func seconds(_ value: JSON?, atMost maximum: Duration) -> Duration? {
        guard let value else { return nil }
        let seconds: Double?
        switch value {
        case let .int(number): seconds = Double(number)
        case let .double(number): seconds = number
        case let .string(text) where text.utf8.count <= 32: seconds = Double(text)
        default: seconds = nil
        }
        guard let seconds, seconds.isFinite, seconds > 0 else { return nil }
        return seconds >= maximum.seconds ? maximum : .milliseconds(Int64((seconds * 1000).rounded(.up)))
    }

    /// The longest token lifetime believed (a longer `expires_in` is taken as this).
    static let longestLifetime: Duration = .seconds(10 * 365 * 86400)
    /// The longest wait a `Retry-After` may impose.
    static let longestRetryAfter: Duration = .seconds(86400)
}
