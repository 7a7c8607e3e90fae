/// A configuration problem, located at `file:line`.
public struct ConfigError: Error, Sendable, Equatable, CustomStringConvertible {
    public var file: String
    public var line: Int
    public var message: String

    public init(file: String, line: Int, _ message: String) {
        self.file = file
        self.line = line
        self.message = message
    }

    public var description: String { line > 0 ? "\(file):\(line): \(message)" : "\(file): \(message)" }
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
    public static func parse(_ text: String, file: String) throws(ConfigError) -> [INISection] {
        var sections: [INISection] = []
        var pending = ""
        var pendingLine = 0
        var number = 0
        for rawLine in text.split(separator: "\n", omittingEmptySubsequences: false) {
            number += 1
            var line = Substring(rawLine)
            if line.hasSuffix("\r") { line = line.dropLast() }
            if pending.isEmpty {
                let trimmed = line.trimmingSpaces
                if trimmed.isEmpty || trimmed.hasPrefix("#") || trimmed.hasPrefix(";") { continue }
                pendingLine = number
            }
            // A continued line joins the next one with a single space.
            if line.hasSuffix("\\") {
                pending += line.dropLast().trimmingSpaces + " "
                continue
            }
            let logical = (pending + line.trimmingSpaces).trimmingSpaces
            pending = ""
            if logical.hasPrefix("[") {
                guard logical.hasSuffix("]"), logical.count > 2 else {
                    throw ConfigError(file: file, line: pendingLine, "malformed section header (expected '[Name]')")
                }
                let name = String(logical.dropFirst().dropLast()).trimmingSpaces
                guard !name.isEmpty, name.allSatisfy({ $0.isLetter || $0.isNumber }) else {
                    throw ConfigError(file: file, line: pendingLine, "invalid section name '\(name)'")
                }
                sections.append(INISection(name: name, file: file, line: pendingLine, entries: []))
                continue
            }
            guard let equals = logical.firstIndex(of: "=") else {
                // The line is not quoted: it might be a secret pasted in the wrong place.
                throw ConfigError(file: file, line: pendingLine, "expected 'Key=Value' or '[Section]'")
            }
            let key = String(logical[..<equals]).trimmingSpaces
            let value = String(logical[logical.index(after: equals)...]).trimmingSpaces
            guard !key.isEmpty, key.allSatisfy({ $0.isLetter || $0.isNumber }) else {
                throw ConfigError(file: file, line: pendingLine, "invalid key '\(key)'")
            }
            guard !sections.isEmpty else {
                throw ConfigError(file: file, line: pendingLine, "'\(key)=' is outside of any [Section]")
            }
            sections[sections.count - 1].entries.append(INIEntry(key: key, value: value, file: file, line: pendingLine))
        }
        if !pending.isEmpty {
            throw ConfigError(file: file, line: pendingLine, "the file ends inside a continued line")
        }
        return sections
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
