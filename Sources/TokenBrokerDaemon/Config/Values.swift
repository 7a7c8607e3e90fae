/// Parsers for configuration values, each failing with a message for `file:line`.
enum ConfigValue {
    /// A systemd-style time span: `90`, `90s`, `5min`, `1h 30min`, `250ms`; at most 100 years
    /// (anything longer is a typo, and would not fit in the arithmetic).
    static func duration(_ text: String) -> Duration? {
        let units: [(String, Double)] = [("usec", 1e-6), ("us", 1e-6), ("msec", 1e-3), ("ms", 1e-3), ("seconds", 1), ("second", 1),
                                         ("sec", 1), ("s", 1), ("minutes", 60), ("minute", 60), ("min", 60), ("m", 60),
                                         ("hours", 3600), ("hour", 3600), ("hr", 3600), ("h", 3600), ("days", 86400), ("day", 86400), ("d", 86400)]
        var total = 0.0
        var rest = Substring(text.trimmingSpaces)
        guard !rest.isEmpty else { return nil }
        while !rest.isEmpty {
            let number = rest.prefix { ("0"..."9").contains($0) || $0 == "." }
            guard !number.isEmpty, let value = Double(number) else { return nil }
            rest = rest.dropFirst(number.count).drop { $0 == " " }
            let unitText = rest.prefix { $0.isLetter }
            rest = rest.dropFirst(unitText.count).drop { $0 == " " }
            if unitText.isEmpty {
                total += value
            } else if let unit = units.first(where: { $0.0 == unitText }) {
                total += value * unit.1
            } else {
                return nil
            }
        }
        let milliseconds = (total * 1000).rounded()
        guard milliseconds.isFinite, milliseconds <= 100 * 366 * 86_400_000 else { return nil }
        return .milliseconds(Int64(milliseconds))
    }

    /// A size: `1048576`, `64K`, `1M`, `1G` (binary multiples; `k`, `m`, `g` too). `nil` when it
    /// is not one or does not fit in an `Int`.
    static func size(_ text: String) -> Int? {
        let trimmed = text.trimmingSpaces
        let multipliers: [Character: Int] = ["K": 1 << 10, "k": 1 << 10, "M": 1 << 20, "m": 1 << 20, "G": 1 << 30, "g": 1 << 30]
        guard let last = trimmed.last, let multiplier = multipliers[last] else { return Int(trimmed) }
        guard let number = Int(trimmed.dropLast()) else { return nil }
        let (size, overflow) = number.multipliedReportingOverflow(by: multiplier)
        return overflow ? nil : size
    }

    /// An octal file mode such as `0660`.
    static func mode(_ text: String) -> UInt32? {
        guard let value = UInt32(text.trimmingSpaces, radix: 8), value <= 0o7777 else { return nil }
        return value
    }

    static func bool(_ text: String) -> Bool? {
        switch text.trimmingSpaces.lowercased() {
        case "1", "yes", "true", "on": return true
        case "0", "no", "false", "off": return false
        default: return nil
        }
    }

    /// Whitespace-separated words.
    static func list(_ text: String) -> [String] {
        text.split(whereSeparator: { $0 == " " || $0 == "\t" }).map(String.init)
    }

    /// A session name: letters, digits, `-`, `_`, `.`; 1 to 64 characters.
    static func isSessionName(_ text: String) -> Bool {
        (1...64).contains(text.count) && text.allSatisfy { $0.isASCII && ($0.isLetter || $0.isNumber || "-_.".contains($0)) }
    }
}
