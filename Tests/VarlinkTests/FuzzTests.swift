#if canImport(Glibc)
import Glibc
#endif
import Testing
import TestSupport
import Varlink

/// Random mutations of valid messages through the parser and the call decoder: every input must
/// end in a value or a thrown error, never a trap (a client's bad bytes must cost only that
/// client). `TB_FUZZ_ITERATIONS` sets the count (default 20,000); the seed is printed.
@Suite("Parser fuzzing")
struct FuzzTests {
    static let seeds: [String] = [
        #"{"method":"io.tokenbroker.Broker.GetToken","parameters":{"session":"api"}}"#,
        #"{"method":"a.b.C","parameters":{"x":[1,2.5e-3,-0,true,null,{"y":"\u00e9\ud83d\ude00\n"}]},"more":true}"#,
        #"{"parameters":{"token":"abc","expiresAt":1800000000},"continues":true}"#,
        #"[[[[[[[[[[{"a":[{"b":[]}]}]]]]]]]]]]"#,
        #""\\\"\/\b\f\n\r\t\u0000""#,
    ]

    @Test("mutated messages never trap the parser or the call decoder")
    func mutations() {
        let iterations = SeededRandom.iterations(default: 20_000)
        let seed = SeededRandom.seed()
        print("fuzz: \(iterations) inputs, TB_FUZZ_SEED=\(seed)")
        var random = SeededRandom(seed: seed)
        let interesting: [UInt8] = Array("{}[]\":,\\-+.eE0123456789tfnu\u{7f}".utf8) + [0x00, 0x80, 0xC3, 0xED, 0xF4, 0xFF, 0x20]
        var accepted = 0
        for _ in 0..<iterations {
            var bytes = Array(Self.seeds[Int(random.next() % UInt64(Self.seeds.count))].utf8)
            for _ in 0..<(1 + Int(random.next() % 4)) {
                let position = bytes.isEmpty ? 0 : Int(random.next() % UInt64(bytes.count))
                switch random.next() % 4 {
                case 0 where !bytes.isEmpty: bytes[position] = interesting[Int(random.next() % UInt64(interesting.count))]
                case 1: bytes.insert(interesting[Int(random.next() % UInt64(interesting.count))], at: position)
                case 2 where !bytes.isEmpty: bytes.remove(at: position)
                default: bytes = Array(bytes[..<position]) + Array(bytes[position...]).reversed()
                }
            }
            if (try? JSONParser.parse(bytes)) != nil { accepted += 1 }
            _ = try? VarlinkCall.decode(ArraySlice(bytes))
            _ = try? VarlinkReply.decode(ArraySlice(bytes))
            var decoder = FrameDecoder(maximumSize: 256)
            decoder.append(contentsOf: bytes)
            while (try? decoder.next()) != nil {}
        }
        print("fuzz: \(accepted) of \(iterations) mutated inputs were still valid JSON")
        #expect(accepted < iterations)
    }
}
