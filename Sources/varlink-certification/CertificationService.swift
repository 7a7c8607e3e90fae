import Synchronization
import Varlink

/// The service side: checks that each client calls the methods in order with the expected
/// arguments.
final class CertificationService: VarlinkHandler {
    private let next = Mutex<[String: String]>([:])
    private let counter = Atomic<Int>(0)

    func handle(_ call: VarlinkCall, from peer: PeerCredentials) -> VarlinkHandling {
        let reply = answer(call)
        guard call.member == "Test10", reply.error == nil else { return .reply(reply) }
        // Test10 answers with ten replies, all but the last marked "continues".
        return .async { sink in
            for (index, text) in Certification.moreReplies.enumerated() {
                sink.send(VarlinkReply(parameters: ["string": text], continues: index < 9))
            }
        }
    }

    private func answer(_ call: VarlinkCall) -> VarlinkReply {
        let method = call.member
        let parameters = call.parameters
        if method == "Start" {
            guard parameters.isEmpty else { return mismatch(wants: [:], got: parameters) }
            let id = "swift-\(counter.add(1, ordering: .relaxed).newValue)"
            next.withLock { $0[id] = "Test01" }
            return VarlinkReply(parameters: ["client_id": .string(id)])
        }
        guard let id = parameters["client_id"]?.stringValue, let expected = next.withLock({ $0[id] }) else {
            return .error("org.varlink.certification.ClientIdError")
        }
        guard expected == method else {
            next.withLock { $0[id] = nil }
            return mismatch(wants: ["method": .string("org.varlink.certification." + expected)], got: ["method": .string(call.method)])
        }
        var arguments = parameters
        arguments["client_id"] = nil
        let wants: JSONObject
        let reply: VarlinkReply
        let following: String?
        switch method {
        case "Test01": (wants, reply, following) = ([:], VarlinkReply(parameters: ["bool": true]), "Test02")
        case "Test02": (wants, reply, following) = (["bool": true], VarlinkReply(parameters: ["int": 1]), "Test03")
        case "Test03": (wants, reply, following) = (["int": 1], VarlinkReply(parameters: ["float": 1.0]), "Test04")
        case "Test04": (wants, reply, following) = (["float": 1.0], VarlinkReply(parameters: ["string": "ping"]), "Test05")
        case "Test05": (wants, reply, following) = (["string": "ping"], VarlinkReply(parameters: Certification.basics), "Test06")
        case "Test06":
            (wants, reply, following) = (Certification.basics, VarlinkReply(parameters: ["struct": .object(Certification.basics)]), "Test07")
        case "Test07":
            (wants, reply, following) = (["struct": .object(Certification.basics)], VarlinkReply(parameters: ["map": Certification.map]), "Test08")
        case "Test08": (wants, reply, following) = (["map": Certification.map], VarlinkReply(parameters: ["set": Certification.set]), "Test09")
        case "Test09": (wants, reply, following) = (["set": Certification.set], VarlinkReply(parameters: ["mytype": Certification.myType]), "Test10")
        case "Test10":
            guard call.more else { return .error(VarlinkServiceError.expectedMore) }
            (wants, reply, following) = (["mytype": Certification.myType], VarlinkReply(), "Test11")
        case "Test11":
            (wants, reply, following) = (["last_more_replies": .array(Certification.moreReplies)], VarlinkReply(), call.oneway ? "End" : nil)
        case "End": (wants, reply, following) = ([:], VarlinkReply(parameters: ["all_ok": true]), nil)
        default: return .error(VarlinkServiceError.methodNotFound, ["method": .string(call.method)])
        }
        guard Certification.same(.object(wants), .object(arguments)), method != "Test11" || following != nil else {
            next.withLock { $0[id] = nil }
            return mismatch(wants: wants, got: arguments)
        }
        next.withLock { $0[id] = following }
        return reply
    }

    private func mismatch(wants: JSONObject, got: JSONObject) -> VarlinkReply {
        .error("org.varlink.certification.CertificationError", ["wants": .object(wants), "got": .object(got)])
    }
}

