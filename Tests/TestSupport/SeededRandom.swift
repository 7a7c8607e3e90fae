#if canImport(Glibc)
import Glibc
#endif

/// A small, fast, seedable generator (SplitMix64), so that a randomized test prints its seed
/// and a failure can be replayed exactly.
public struct SeededRandom: RandomNumberGenerator {
    public private(set) var state: UInt64

    public init(seed: UInt64) { state = seed }

    public mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }

    /// A random element of `choices`.
    public mutating func pick<T>(_ choices: [T]) -> T {
        choices[Int(next() % UInt64(choices.count))]
    }

    /// The seed from `TB_FUZZ_SEED` when set, else a fresh one.
    public static func seed(from variable: String = "TB_FUZZ_SEED") -> UInt64 {
        getenv(variable).flatMap { UInt64(String(cString: $0)) } ?? UInt64.random(in: 1...UInt64.max)
    }

    /// `TB_FUZZ_ITERATIONS` when set, else `default`.
    public static func iterations(default count: Int) -> Int {
        getenv("TB_FUZZ_ITERATIONS").flatMap { Int(String(cString: $0)) } ?? count
    }
}
