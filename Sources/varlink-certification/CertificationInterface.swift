import Varlink

/// `org.varlink.certification`: the interface independent varlink implementations test each
/// other with. A client calls Start, Test01 … Test11 and End, each with what the previous call
/// returned; the service checks every argument and answers `CertificationError` on a mismatch.
enum Certification {
    static let interface = VarlinkInterface(description: """
        # The varlink certification interface. A client calls Start, then Test01 to Test11 and
        # End in order, passing on what the previous call returned; the service checks each call.
        interface org.varlink.certification

        # A type with anonymous structures, maps and optional values nested inside.
        type Interface (
          foo: ?[]?[string](foo, bar, baz),
          anon: (foo: bool, bar: bool)
        )

        # Every kind of value at once.
        type MyType (
          object: object,
          enum: (one, two, three),
          struct: (first: int, second: string),
          array: []string,
          dictionary: [string]string,
          stringset: [string](),
          nullable: ?string,
          nullable_array_struct: ?[](first: int, second: string),
          interface: Interface
        )

        # Begins a run and names it.
        method Start() -> (client_id: string)

        # Returns a bool.
        method Test01(client_id: string) -> (bool: bool)

        # Takes the bool, returns an int.
        method Test02(client_id: string, bool: bool) -> (int: int)

        # Takes the int, returns a float.
        method Test03(client_id: string, int: int) -> (float: float)

        # Takes the float, returns a string.
        method Test04(client_id: string, float: float) -> (string: string)

        # Takes the string, returns one value of each basic type.
        method Test05(client_id: string, string: string) -> (
          bool: bool,
          int: int,
          float: float,
          string: string
        )

        # Takes the basic values, returns them as a structure.
        method Test06(
          client_id: string,
          bool: bool,
          int: int,
          float: float,
          string: string
        ) -> (
          struct: (
            bool: bool,
            int: int,
            float: float,
            string: string
          )
        )

        # Takes the structure, returns a map.
        method Test07(
          client_id: string,
          struct: (
            bool: bool,
            int: int,
            float: float,
            string: string
          )
        ) -> (map: [string]string)

        # Takes the map, returns a set.
        method Test08(client_id: string, map: [string]string) -> (set: [string]())

        # Takes the set, returns a MyType.
        method Test09(client_id: string, set: [string]()) -> (mytype: MyType)

        # Takes the MyType; answers with several replies ("continues").
        method Test10(client_id: string, mytype: MyType) -> (string: string)

        # Takes the strings of Test10's replies; must be called oneway.
        method Test11(client_id: string, last_more_replies: []string) -> ()

        # Ends the run.
        method End(client_id: string) -> (all_ok: bool)

        # The client_id is unknown.
        error ClientIdError ()

        # A call did not carry what the service expected.
        error CertificationError (wants: object, got: object)

        """)

    static let pi = 3.141592653589793
    static let basics: JSONObject = ["bool": false, "int": 2, "float": .double(pi), "string": "a lot of string"]
    static let map: JSON = ["foo": "Foo", "bar": "Bar"]
    static let set: JSON = ["one": [:], "two": [:], "three": [:]]
    static let myType: JSON = [
        "object": ["method": "org.varlink.certification.Test09", "parameters": ["map": ["foo": "Foo", "bar": "Bar"]]],
        "enum": "two",
        "struct": ["first": 1, "second": "2"],
        "array": ["one", "two", "three"],
        "dictionary": ["foo": "Foo", "bar": "Bar"],
        "stringset": ["one": [:], "two": [:], "three": [:]],
        "interface": [
            "foo": [nil, ["foo": "foo", "bar": "bar"], nil, ["one": "foo", "two": "bar"]],
            "anon": ["foo": true, "bar": false],
        ],
    ]
    static let moreReplies: [JSON] = (1...10).map { .string("Reply number \($0)") }

    /// Equality of JSON values where numbers compare by value (`1` equals `1.0`) and absent
    /// optional members equal `null`.
    static func same(_ a: JSON?, _ b: JSON?) -> Bool {
        switch (a, b) {
        case (nil, nil), (nil, .null?), (.null?, nil): return true
        case let (.object(x)?, .object(y)?):
            let keys = Set(x.keys).union(y.keys)
            return keys.allSatisfy { same(x[$0], y[$0]) }
        case let (.array(x)?, .array(y)?):
            return x.count == y.count && zip(x, y).allSatisfy { same($0, $1) }
        case let (x?, y?):
            if let p = x.doubleValue, let q = y.doubleValue { return p == q }
            return x == y
        default:
            return false
        }
    }
}
