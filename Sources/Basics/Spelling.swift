/// "Did you mean …?": the known name a mistyped one probably meant.
public enum Spelling {
    /// The first of `candidates` equal to `name` but for case, or at most two single-byte
    /// edits from it (names of up to 64 bytes; a longer one matches nothing).
    public static func closest(to name: String, in candidates: some Sequence<String>) -> String? {
        let lower = Array(name.lowercased().utf8)
        return candidates.first { candidate in
            let other = Array(candidate.lowercased().utf8)
            return other == lower || (abs(other.count - lower.count) <= 2 && editDistance(other, lower, within: 2))
        }
    }

    /// Whether `a` and `b` are at most `limit` single-byte edits apart (Levenshtein).
    static func editDistance(_ a: [UInt8], _ b: [UInt8], within limit: Int) -> Bool {
        guard a.count <= 64, b.count <= 64 else { return false }
        guard !a.isEmpty else { return b.count <= limit }
        var previous = Array(0...b.count)
        for i in 1...a.count {
            var current = [i] + Array(repeating: 0, count: b.count)
            for j in stride(from: 1, through: b.count, by: 1) {
                current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1))
            }
            previous = current
        }
        return previous[b.count] <= limit
    }
}
