/// Parsers for configuration values, each failing with a message for `file:line`.
enum ConfigValue {
    /// A systemd-style time span: `90`, `90s`, `5min`, `1h 30min`, `250ms`; at most 100 years
    /// (anything longer is a typo, and would not fit in the arithmetic).
    static func duration(_ text: String) -> Duration? {
        if text.utf8.allSatisfy({ $0 < 0x80 }) { return asciiDuration(Array(text.utf8)) }
        return characterDuration(text)
    }

    private static let units: [(String, Double)] = [
        ("usec", 1e-6), ("us", 1e-6), ("msec", 1e-3), ("ms", 1e-3), ("seconds", 1), ("second", 1), ("sec", 1), ("s", 1),
        ("minutes", 60), ("minute", 60), ("min", 60), ("m", 60), ("hours", 3600), ("hour", 3600), ("hr", 3600), ("h", 3600),
        ("days", 86400), ("day", 86400), ("d", 86400),
    ]

    /// The units by their letters packed in an integer (at most 8 of them), for the byte reading.
    private static let packedUnits: [UInt64: Double] = Dictionary(uniqueKeysWithValues: units.map { unit in
        (unit.0.utf8.reduce(UInt64(0)) { $0 << 8 | UInt64($1) }, unit.1)
    })

    /// `duration` of ASCII text, byte by byte (thousands of sessions each have a few): the same
    /// reading as `characterDuration`, which any other text gets.
    private static func asciiDuration(_ bytes: [UInt8]) -> Duration? {
        func isSpace(_ byte: UInt8) -> Bool { byte == UInt8(ascii: " ") || byte == UInt8(ascii: "\t") }
        var start = 0, end = bytes.count
        while start < end, isSpace(bytes[start]) { start += 1 }
        while end > start, isSpace(bytes[end - 1]) { end -= 1 }
        guard start < end else { return nil }
        var total = 0.0
        var index = start
        while index < end {
            let numberStart = index
            while index < end, (0x30...0x39).contains(bytes[index]) || bytes[index] == UInt8(ascii: ".") { index += 1 }
            guard index > numberStart, let value = number(bytes[numberStart..<index]) else { return nil }
            while index < end, bytes[index] == UInt8(ascii: " ") { index += 1 }
            let unitStart = index
            while index < end, (0x41...0x5A).contains(bytes[index]) || (0x61...0x7A).contains(bytes[index]) { index += 1 }
            let unit = bytes[unitStart..<index]
            while index < end, bytes[index] == UInt8(ascii: " ") { index += 1 }
            if unit.isEmpty {
                total += value
            } else if unit.count <= 8, let scale = packedUnits[unit.reduce(UInt64(0)) { $0 << 8 | UInt64($1) }] {
                total += value * scale
            } else {
                return nil
            }
        }
        return bounded(total)
    }

    /// Digits (and dots) as a number: whole numbers of up to 15 digits directly, any other as
    /// `Double` reads its text.
    private static func number(_ bytes: ArraySlice<UInt8>) -> Double? {
        if bytes.count <= 15, !bytes.contains(UInt8(ascii: ".")) {
            return Double(bytes.reduce(Int64(0)) { $0 * 10 + Int64($1 - UInt8(ascii: "0")) })
        }
        return Double(String(decoding: bytes, as: UTF8.self))
    }

    private static func bounded(_ total: Double) -> Duration? {
        let milliseconds = (total * 1000).rounded()
        guard milliseconds.isFinite, milliseconds <= 100 * 366 * 86_400_000 else { return nil }
        return .milliseconds(Int64(milliseconds))
    }

    /// `duration` read character by character (any text; the reference the ASCII reading is tested against).
    static func characterDuration(_ text: String) -> Duration? {
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
        // ASCII only, so bytes are characters.
        (1...64).contains(text.utf8.count) && text.utf8.allSatisfy { byte in
            (0x30...0x39).contains(byte) || (0x41...0x5A).contains(byte) || (0x61...0x7A).contains(byte)
                || byte == UInt8(ascii: "-") || byte == UInt8(ascii: "_") || byte == UInt8(ascii: ".")
        }
    }
}
