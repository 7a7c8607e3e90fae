import Testing
import TestSupport
import Varlink

@Suite("JSON")
struct JSONTests {
    @Test("integers are written as their decimal text, the extremes included")
    func integers() {
        var random = SeededRandom(seed: 23)
        var values: [Int64] = [0, 1, 9, 10, 99, 100, -1, -9, -10, 1_000_000_007, Int64.max, Int64.min, Int64.max - 1, Int64.min + 1]
        for _ in 0..<2000 { values.append(Int64(bitPattern: random.next()) >> Int64(random.next() % 63)) }
        for value in values {
            var bytes: [UInt8] = []
            JSON.int(value).encode(into: &bytes)
            #expect(String(decoding: bytes, as: UTF8.self) == String(value))
        }
    }

    @Test("round trip of every kind of value, compact and in member order")
    func goldenEncoding() throws {
        let value: JSON = [
            "s": "a \"quoted\" \\ line\nnext\t\u{01}é😀", "i": -42, "big": .int(Int64.max), "d": 3.141592653589793,
            "whole": 2.0, "t": true, "f": false, "n": nil, "a": [1, "two", [], [:]], "o": ["x": ["y": 1]],
        ]
        let text = value.text
        #expect(text == #"{"s":"a \"quoted\" \\ line\nnext\t\u0001é😀","i":-42,"big":9223372036854775807,"d":3.141592653589793,"whole":2.0,"t":true,"f":false,"n":null,"a":[1,"two",[],{}],"o":{"x":{"y":1}}}"#)
        #expect(try JSONParser.parse(text) == value)
    }

    @Test("accepted inputs", arguments: [
        (#" { "a" : [ 1 , 2.5e3 , -0 , 1E-2 ] } "#, JSON.object(["a": [1, 2500.0, 0, 0.01]])),
        (#""\u00e9\ud83d\ude00\/""#, .string("é😀/")),
        ("12345678901234567890", .double(1.2345678901234567e19)),
        ("-9223372036854775808", .int(Int64.min)),
        ("null", .null),
    ])
    func accepted(text: String, expected: JSON) throws {
        #expect(try JSONParser.parse(text) == expected)
    }

    @Test("rejected inputs", arguments: [
        "", "{", "[1,]", "{\"a\":1,}", "01", "1.", ".5", "-", "1e", "+1", "NaN", "Infinity", "tru", "nul",
        "\"\u{01}\"", "\"\\x\"", "\"\\u12\"", "\"\\ud83d\"", "\"\\ude00\"", "{\"a\":1,\"a\":2}", "{a:1}", "[1] 2",
        "1e999", "'x'", "[" + String(repeating: "[", count: 70) + String(repeating: "]", count: 71),
    ])
    func rejected(text: String) {
        #expect(throws: JSONParseError.self) { try JSONParser.parse(text) }
    }

    @Test("large objects: duplicates found wherever they are (hashed past 8 members), members capped by the limits")
    func largeObjects() throws {
        func object(_ keys: [String]) -> String { "{" + keys.map { "\"\($0)\":0" }.joined(separator: ",") + "}" }
        let distinct = (0..<1024).map { "k\($0)" }
        #expect(try JSONParser.parse(object(distinct)).objectValue?.count == 1024)
        for position in [1, 7, 8, 9, 500, 1023] {
            var keys = Array(distinct.prefix(1023))
            keys.insert(keys[position - 1], at: position)
            let error = #expect(throws: JSONParseError.self) { try JSONParser.parse(object(keys)) }
            #expect(error?.reason == "duplicate member name" && error?.offset == object(Array(keys.prefix(position))).utf8.count)
        }
        #expect(throws: JSONParseError.self) { try JSONParser.parse(object(distinct + ["one more"])) }
        #expect(try JSONParser.parse(object(Array(distinct.prefix(20))), limits: JSONLimits(maximumMembers: 20)).objectValue?.count == 20)
        #expect(throws: JSONParseError.self) { try JSONParser.parse(object(Array(distinct.prefix(21))), limits: JSONLimits(maximumMembers: 20)) }
        #expect(throws: JSONParseError.self) { try JSONParser.parse("[[[[1]]]]", limits: JSONLimits(maximumDepth: 3)) }
    }

    @Test("invalid UTF-8 is rejected: bad continuations, overlong forms, surrogates, beyond U+10FFFF, truncated; valid UTF-8 (U+FFFD too) comes through unchanged")
    func invalidUTF8() throws {
        let invalid: [[UInt8]] = [[0xC3, 0x28], [0xFF], [0x80], [0xC0, 0x80], [0xE0, 0x80, 0xAF], [0xED, 0xA0, 0x80],
                                  [0xF4, 0x90, 0x80, 0x80], [0xF5, 0x80, 0x80, 0x80], [0xE2, 0x82], [0xF0, 0x9F, 0x98]]
        for bytes in invalid {
            #expect(throws: JSONParseError.self, "\(bytes)") { try JSONParser.parse([0x22] + bytes + [0x22]) }
            #expect(throws: JSONParseError.self, "\(bytes) after an escape") { try JSONParser.parse([0x22, 0x5C, 0x6E] + bytes + [0x22]) }
        }
        // Byte for byte (String's == would also accept a canonically equivalent rewrite).
        for text in ["é", "e\u{301}", "€", "𝄞", "\u{FFFD}", "\u{10FFFF}", "a\u{7F}b"] {
            #expect(try JSONParser.parse([0x22] + Array(text.utf8) + [0x22]).stringValue.map { Array($0.utf8) } == Array(text.utf8))
            #expect(try JSONParser.parse([0x22, 0x5C, 0x6E] + Array(text.utf8) + [0x22]).stringValue.map { Array($0.utf8) } == [0x0A] + Array(text.utf8))
        }
    }

    @Test("strings: the parser accepts exactly the byte sequences the standard library's validation accepts (seeded random bytes)")
    func utf8Differential() {
        var random = SeededRandom(seed: 29)
        let alphabet: [UInt8] = [0x41, 0x7F, 0x80, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE2, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x9F, 0xA0, 0x90, 0x8F, 0xBD]
        for _ in 0..<20_000 {
            let bytes = (0..<Int.random(in: 1...6, using: &random)).map { _ in alphabet.randomElement(using: &random)! }
            let expected = String(validating: bytes, as: UTF8.self)
            let parsed = (try? JSONParser.parse([0x22] + bytes + [0x22]))?.stringValue
            #expect(parsed.map { Array($0.utf8) } == expected.map { Array($0.utf8) }, "\(bytes)")
            if expected != nil { #expect(parsed.map { Array($0.utf8) } == bytes, "\(bytes)") }
        }
    }
}

@Suite("Frames and messages")
struct FramingTests {
    static let messages: [String] = [
        #"{"method":"org.varlink.service.GetInfo"}"#,
        #"{"method":"io.example.Echo","parameters":{"text":"a\u0000b"}}"#,
        #"{"method":"io.example.Stream","more":true}"#,
    ]

    @Test("every split point of a stream of several messages yields the same messages")
    func everySplitPoint() throws {
        let stream: [UInt8] = Self.messages.flatMap { message -> [UInt8] in Array(message.utf8) + [0] }
        for split in 0...stream.count {
            var decoder = FrameDecoder(maximumSize: 1024)
            var frames: [String] = []
            for part in [stream[..<split], stream[split...]] {
                decoder.append(contentsOf: part)
                while let frame = try decoder.next() { frames.append(String(decoding: frame, as: UTF8.self)) }
            }
            #expect(frames == Self.messages, "split at \(split)")
            #expect(decoder.pendingCount == 0)
        }
    }

    @Test("byte by byte, and all at once")
    func dripAndFlood() throws {
        let stream: [UInt8] = Array(repeating: Self.messages, count: 100).joined().flatMap { message -> [UInt8] in Array(message.utf8) + [0] }
        var drip = FrameDecoder(maximumSize: 1024)
        var count = 0
        for byte in stream {
            drip.append(contentsOf: [byte])
            while try drip.next() != nil { count += 1 }
        }
        #expect(count == 300)
        var flood = FrameDecoder(maximumSize: 1024)
        flood.append(contentsOf: stream)
        count = 0
        while try flood.next() != nil { count += 1 }
        #expect(count == 300)
    }

    @Test("an unfinished message past the limit fails before it is complete; one at the limit passes")
    func limit() throws {
        var decoder = FrameDecoder(maximumSize: 16)
        decoder.append(contentsOf: Array(repeating: UInt8(ascii: "x"), count: 16) + [0])
        #expect(try decoder.next()?.count == 16)
        decoder.append(contentsOf: Array(repeating: UInt8(ascii: "x"), count: 17))
        #expect(throws: FrameError.oversized(limit: 16)) { try decoder.next() }
    }

    @Test("calls: flags, parameters, vendor keys; malformed ones are refused")
    func calls() throws {
        let call = try VarlinkCall.decode(ArraySlice(#"{"method":"a.b.C","parameters":{"x":1},"more":true,"io.vendor":{}}"#.utf8))
        #expect(call.method == "a.b.C" && call.interface == "a.b" && call.member == "C" && call.more && !call.oneway)
        #expect(call.parameters["x"] == 1)
        let bare = try VarlinkCall.decode(ArraySlice(#"{"method":"a.b.C","parameters":null,"oneway":null,"more":false}"#.utf8))
        #expect(bare.parameters.isEmpty && !bare.more)
        for bad in [#"[]"#, #"{}"#, #"{"method":1}"#, #"{"method":"a.b.C","parameters":[]}"#, #"{"method":"a.b.C","more":"yes"}"#,
                    #"{"method":"a.b.C","unknown":1}"#, #"{"method":"a.b.C","more":true,"oneway":true}"#, "{"] {
            #expect(throws: VarlinkProtocolError.self, "\(bad)") { try VarlinkCall.decode(ArraySlice(bad.utf8)) }
        }
        #expect(String(decoding: VarlinkCall(method: "a.b.C", parameters: ["x": "y"], more: true).encoded(), as: UTF8.self)
                == #"{"method":"a.b.C","parameters":{"x":"y"},"more":true}"# + "\0")
    }

    @Test("replies: golden encoding and tolerant decoding")
    func replies() throws {
        #expect(String(decoding: VarlinkReply(parameters: ["a": 1], continues: true).encoded(), as: UTF8.self)
                == #"{"parameters":{"a":1},"continues":true}"# + "\0")
        #expect(String(decoding: VarlinkReply.error("x.y.Z", ["p": "q"]).encoded(), as: UTF8.self)
                == #"{"error":"x.y.Z","parameters":{"p":"q"}}"# + "\0")
        #expect(try VarlinkReply.decode(ArraySlice(#"{"extra":1}"#.utf8)) == VarlinkReply())
        #expect(try VarlinkReply.decode(ArraySlice(#"{"parameters":null,"error":"a.B"}"#.utf8)).error == "a.B")
    }

    @Test("descriptions of calls and replies hide the members an interface declares secret, at any depth")
    func redaction() {
        _ = VarlinkInterface(description: "interface a.b\nmethod Recover(rejected: string) -> (token: string)",
                             secretMembers: ["token", "refreshToken", "client_secret", "rejected"])
        let reply = VarlinkReply(parameters: ["token": "hunter2", "tokenType": "Bearer", "tokenSerial": 3,
                                              "nested": ["refreshToken": "hunter3", "client_secret": "hunter4"]])
        let call = VarlinkCall(method: "a.b.Recover", parameters: ["session": "api", "rejected": "hunter5"])
        for text in ["\(reply)", "\(call)", String(reflecting: reply)] {
            #expect(!text.contains("hunter"), "\(text.count) characters")
        }
        #expect("\(reply)".contains("\"tokenType\":\"Bearer\"") && "\(reply)".contains("\"tokenSerial\":3"))
        #expect(String(decoding: reply.encoded(), as: UTF8.self).contains("hunter2"))
    }

    @Test("an interface description yields its name and methods")
    func interface() {
        let interface = VarlinkInterface(description: """
            # A comment with method Fake() -> ()
            interface io.example.Thing

            # Doc.
            method Get(id: string) -> (value: ?int)
            method  Put (id: string) -> ()
            type Method (x: int)
            error NotFound (id: string)
            """)
        #expect(interface.name == "io.example.Thing")
        #expect(interface.methods == ["Get", "Put"])
    }
}
