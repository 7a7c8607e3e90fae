import Synchronization
import TokenBrokerCore

/// `Upstream=test`: mints tokens inside the daemon, for development, tests and benchmarks. No
/// network; every fetch returns a fresh random access token and rotates the refresh token.
final class TestTokenSource: TokenSource {
    private let lifetime: Duration
    private let minted = Atomic<Int>(0)

    init(lifetime: Duration) {
        self.lifetime = lifetime
    }

    func fetch(_ request: FetchRequest) async throws -> FetchedToken {
        let serial = minted.add(1, ordering: .relaxed).newValue
        return FetchedToken(accessToken: Secret("tbtest.\(serial).\(Self.random())"), tokenType: "Bearer",
                            expiresIn: lifetime, refreshToken: Secret("tbtest-refresh.\(Self.random())"))
    }

    /// 128 random bits as URL-safe text.
    static func random() -> String {
        var generator = SystemRandomNumberGenerator()
        let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
        return String((0..<22).map { _ in alphabet[Int(generator.next() % 64)] })
    }
}

/// The system's calendar time.
struct SystemWallClock: WallClock {
    func unixTime() -> Double {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        return Double(now.tv_sec) + Double(now.tv_nsec) / 1e9
    }
}

#if canImport(Glibc)
import Glibc
#endif
