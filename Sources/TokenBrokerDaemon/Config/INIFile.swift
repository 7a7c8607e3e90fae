/// A configuration problem, located at `file:line`.
public struct ConfigError: Error, Sendable, Equatable, CustomStringConvertible {
    public var file: String
    public var line: Int
    public var message: String
    /// The errors after this one, in file order: a configuration is read to its end, so one
    /// look shows every mistake (at most `ConfigError.most` in all; `omitted` counts the rest).
    public var further: [ConfigError] = []
    public var omitted = 0
    /// The warnings of the whole read, in file order (an error does not hide the "did you
    /// mean" of the typo that caused it).
    public var warnings: [ConfigError] = []

    /// The most errors one read reports.
    public static let most = 100

    public init(file: String, line: Int, _ message: String) {
        self.file = file
        self.line = line
        self.message = message
    }

    /// Where and what: `file:line: message`.
    public var location: String { line > 0 ? "\(file):\(line): \(message)" : "\(file): \(message)" }

    /// Every error, one per line (the first line is this one's).
    public var description: String {
        ([location] + further.map(\.location) + (omitted > 0 ? ["(and \(omitted) more errors)"] : [])).joined(separator: "\n")
    }

    /// `items` in the order the files are read (`main`, then the drop-ins by name), then by
    /// line; stable otherwise.
    public static func inFileOrder<T>(_ items: [T], main: String?, _ place: (T) -> ConfigError) -> [T] {
        func key(_ item: (offset: Int, element: T)) -> (Int, String, Int, Int) {
            let error = place(item.element)
            return (error.file == main ? 0 : 1, error.file == main ? "" : error.file, error.line, item.offset)
        }
        return items.enumerated().sorted { key($0) < key($1) }.map(\.element)
    }

    /// The first of `errors` (in order), carrying the others and `warnings`.
    static func combined(_ errors: [ConfigError], omitted: Int = 0, warnings: [ConfigError]) -> ConfigError? {
        guard var first = errors.first else { return nil }
        first.further = Array(errors.dropFirst())
        first.omitted = omitted
        first.warnings = warnings
        return first
    }
}

/// One `Key=Value` assignment and where it was written.
public struct INIEntry: Sendable, Equatable {
    public var key: String
    public var value: String
    public var file: String
    public var line: Int
}

/// One `[Section]` and its assignments, in order.
public struct INISection: Sendable, Equatable {
    public var name: String
    public var file: String
    public var line: Int
    public var entries: [INIEntry]
}

/// systemd-style INI: `[Section]` headers, `Key=Value` lines, `#` and `;` comments, a trailing
/// backslash continues a line. Keys are UpperCamel; whitespace around `=` is ignored.
public enum INIFile {
    /// Parses `text` byte by byte (a configuration of thousands of sessions is read at each
    /// reload); names that are not ASCII are checked as characters.
    public static func parse(_ text: String, file: String) throws(ConfigError) -> [INISection] {
        var errors: [ConfigError] = []
        let sections = parse(text, file: file, errors: &errors)
        if let error = ConfigError.combined(errors, warnings: []) { throw error }
        return sections
    }

    /// Parses all of `text`: a line that cannot be read is an error in `errors`, and skipped (the
    /// lines of a section whose header cannot be read, with it).
    public static func parse(_ text: String, file: String, errors: inout [ConfigError]) -> [INISection] {
        var text = text
        // Through a pointer: slices of an array retain and release its storage at each step, and
        // a reload reads a file of thousands of sections.
        return text.withUTF8 { parse($0, file: file, errors: &errors) }
    }

    private static func parse(_ bytes: UnsafeBufferPointer<UInt8>, file: String, errors: inout [ConfigError]) -> [INISection] {
        var sections: [INISection] = []
        var pending: [UInt8] = []
        var continued = false
        var pendingLine = 0
        var number = 0
        var start = 0
        while start <= bytes.count {
            var end = start
            while end < bytes.count, bytes[end] != UInt8(ascii: "\n") { end += 1 }
            defer { start = end + 1 }
            number += 1
            var line = start..<end
            if let last = line.last, bytes[last] == UInt8(ascii: "\r") { line = line.dropLast() }
            if !continued {
                let trimmed = trim(line, bytes)
                if trimmed.isEmpty || bytes[trimmed.lowerBound] == UInt8(ascii: "#") || bytes[trimmed.lowerBound] == UInt8(ascii: ";") { continue }
                pendingLine = number
            }
            // A continued line joins the next one with a single space.
            if let last = line.last, bytes[last] == UInt8(ascii: "\\") {
                pending += bytes[trim(line.dropLast(), bytes)]
                pending.append(UInt8(ascii: " "))
                continued = true
                continue
            }
            let entry: (key: String, value: String)?
            if continued {
                pending += bytes[trim(line, bytes)]
                entry = pending.withUnsafeBufferPointer { logical in
                    parseLine(logical, trim(0..<logical.count, logical), file: file, line: pendingLine, &sections, &errors)
                }
            } else {
                entry = parseLine(bytes, trim(line, bytes), file: file, line: pendingLine, &sections, &errors)
            }
            pending = []
            continued = false
            guard let (key, value) = entry else { continue }
            guard !sections.isEmpty else {
                errors.append(ConfigError(file: file, line: pendingLine, "'\(key)=' is outside of any [Section]"))
                continue
            }
            sections[sections.count - 1].entries.append(INIEntry(key: key, value: value, file: file, line: pendingLine))
        }
        if continued {
            errors.append(ConfigError(file: file, line: pendingLine, "the file ends inside a continued line"))
        }
        return sections
    }

    /// One logical line, `range` of `bytes`, trimmed: a section header (appended to `sections`)
    /// or an assignment (returned), or an error.
    private static func parseLine(_ bytes: UnsafeBufferPointer<UInt8>, _ logical: Range<Int>, file: String, line: Int,
                                  _ sections: inout [INISection], _ errors: inout [ConfigError]) -> (key: String, value: String)? {
        if let first = logical.first, bytes[first] == UInt8(ascii: "[") {
            // A header that cannot be read opens a section no one reads (its lines would
            // otherwise land in the section above).
            guard bytes[logical.upperBound - 1] == UInt8(ascii: "]"), logical.count > 2 else {
                errors.append(ConfigError(file: file, line: line, "malformed section header (expected '[Name]')"))
                sections.append(INISection(name: "", file: file, line: line, entries: []))
                return nil
            }
            let range = trim(logical.dropFirst().dropLast(), bytes)
            let name = string(range, bytes)
            guard isName(range, bytes) else {
                errors.append(ConfigError(file: file, line: line, "invalid section name '\(name)'"))
                sections.append(INISection(name: "", file: file, line: line, entries: []))
                return nil
            }
            // (Room for a typical section's lines at once: growing 1, 2, 4, 8 was a twentieth
            // of reading a file of thousands of sections.)
            var entries: [INIEntry] = []
            entries.reserveCapacity(8)
            sections.append(INISection(name: name, file: file, line: line, entries: entries))
            return nil
        }
        guard let equals = logical.first(where: { bytes[$0] == UInt8(ascii: "=") }) else {
            // The line is not quoted: it might be a secret pasted in the wrong place.
            errors.append(ConfigError(file: file, line: line, "expected 'Key=Value' or '[Section]'"))
            return nil
        }
        let keyRange = trim(logical.lowerBound..<equals, bytes)
        let key = string(keyRange, bytes)
        let value = string(trim((equals + 1)..<logical.upperBound, bytes), bytes)
        guard isName(keyRange, bytes) else {
            errors.append(ConfigError(file: file, line: line, "invalid key '\(key)'"))
            return nil
        }
        return (key, value)
    }

    private static func trim(_ range: Range<Int>, _ bytes: UnsafeBufferPointer<UInt8>) -> Range<Int> {
        var (lower, upper) = (range.lowerBound, range.upperBound)
        while lower < upper, bytes[lower] == UInt8(ascii: " ") || bytes[lower] == UInt8(ascii: "\t") { lower += 1 }
        while upper > lower, bytes[upper - 1] == UInt8(ascii: " ") || bytes[upper - 1] == UInt8(ascii: "\t") { upper -= 1 }
        return lower..<upper
    }

    private static func string(_ range: Range<Int>, _ bytes: UnsafeBufferPointer<UInt8>) -> String {
        String(decoding: UnsafeBufferPointer(rebasing: bytes[range]), as: UTF8.self)
    }

    /// A section or key name, `range` of `bytes`: letters and digits (of any script).
    private static func isName(_ range: Range<Int>, _ bytes: UnsafeBufferPointer<UInt8>) -> Bool {
        guard !range.isEmpty else { return false }
        for index in range {
            let byte = bytes[index]
            // Not ASCII: the name's characters, by Unicode's properties.
            if byte >= 0x80 { return string(range, bytes).allSatisfy { $0.isLetter || $0.isNumber } }
            // Letters and digits: one comparison each after folding case.
            guard (0x30...0x39).contains(byte) || (0x61...0x7A).contains(byte | 0x20) else { return false }
        }
        return true
    }
}

extension StringProtocol {
    var trimmingSpaces: String {
        var scalars = Substring(self)
        while let first = scalars.first, first == " " || first == "\t" { scalars = scalars.dropFirst() }
        while let last = scalars.last, last == " " || last == "\t" { scalars = scalars.dropLast() }
        return String(scalars)
    }
}
