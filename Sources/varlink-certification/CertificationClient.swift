import Varlink

/// The client side: runs Start … End against a service and checks every answer.
struct CertificationClient {
    struct Failure: Error, CustomStringConvertible {
        let description: String
    }

    let client: VarlinkClient

    func run() throws {
        let prefix = "org.varlink.certification."
        func call(_ method: String, _ parameters: JSONObject, more: Bool = false, oneway: Bool = false) throws -> VarlinkReply {
            let reply = try client.call(VarlinkCall(method: prefix + method, parameters: parameters, oneway: oneway, more: more))
            if let error = reply.error { throw Failure(description: "\(method): \(error) \(JSON.object(reply.parameters).text)") }
            return reply
        }
        func expect(_ method: String, _ reply: VarlinkReply, _ wants: JSONObject) throws {
            for (key, value) in wants where !Certification.same(value, reply.parameters[key]) {
                throw Failure(description: "\(method): \(key) is \(reply.parameters[key].map { $0.text } ?? "missing"), wants \(value.text)")
            }
        }
        guard let id = try call("Start", [:]).parameters["client_id"]?.stringValue else {
            throw Failure(description: "Start: no client_id")
        }
        let clientID: JSON = .string(id)
        print("client_id: \(id)")
        try expect("Test01", try call("Test01", ["client_id": clientID]), ["bool": true])
        try expect("Test02", try call("Test02", ["client_id": clientID, "bool": true]), ["int": 1])
        try expect("Test03", try call("Test03", ["client_id": clientID, "int": 1]), ["float": 1.0])
        try expect("Test04", try call("Test04", ["client_id": clientID, "float": 1.0]), ["string": "ping"])
        try expect("Test05", try call("Test05", ["client_id": clientID, "string": "ping"]), Certification.basics)
        var test06 = Certification.basics
        test06["client_id"] = clientID
        try expect("Test06", try call("Test06", test06), ["struct": .object(Certification.basics)])
        try expect("Test07", try call("Test07", ["client_id": clientID, "struct": .object(Certification.basics)]), ["map": Certification.map])
        try expect("Test08", try call("Test08", ["client_id": clientID, "map": Certification.map]), ["set": Certification.set])
        // As the protocol says, each call passes on what the previous one returned. MyType is
        // passed on as received: the Go service spells one nested map differently, and a
        // service checks what it gets back itself (Test10).
        let test09 = try call("Test09", ["client_id": clientID, "set": Certification.set])
        guard let myType = test09.parameters["mytype"], myType.objectValue != nil else {
            throw Failure(description: "Test09: no mytype object")
        }
        var replies = [try call("Test10", ["client_id": clientID, "mytype": myType], more: true)]
        while replies.last?.continues == true { replies.append(try client.nextReply()) }
        let strings = replies.compactMap { $0.parameters["string"] }
        guard strings == Certification.moreReplies else {
            throw Failure(description: "Test10: got \(strings.count) replies: \(JSON.array(strings).text)")
        }
        _ = try call("Test11", ["client_id": clientID, "last_more_replies": .array(strings)], oneway: true)
        try expect("End", try call("End", ["client_id": clientID]), ["all_ok": true])
        print("Certification passed")
    }
}
