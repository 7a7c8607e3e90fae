#if canImport(Glibc)
import Glibc
#endif

/// Unix seconds as text, in UTC (for logs, status lines and `ctl` output).
public enum UTCTime {
    /// The wall clock, in Unix seconds.
    public static func unixSeconds() -> Int64 {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        return Int64(now.tv_sec)
    }

    /// `2026-11-30T09:30:00Z`.
    public static func timestamp(_ seconds: Int64) -> String {
        let parts = broken(seconds)
        return "\(parts.tm_year + 1900)-\(twoDigits(parts.tm_mon + 1))-\(twoDigits(parts.tm_mday))T\(clock(parts))Z"
    }

    /// `09:30:00`.
    public static func timeOfDay(_ seconds: Int64) -> String {
        clock(broken(seconds))
    }

    /// A number with at least two digits.
    public static func twoDigits<N: BinaryInteger>(_ value: N) -> String {
        value < 10 ? "0\(value)" : "\(value)"
    }

    private static func clock(_ parts: tm) -> String {
        "\(twoDigits(parts.tm_hour)):\(twoDigits(parts.tm_min)):\(twoDigits(parts.tm_sec))"
    }

    private static func broken(_ seconds: Int64) -> tm {
        var time = time_t(seconds)
        var parts = tm()
        gmtime_r(&time, &parts)
        return parts
    }
}
