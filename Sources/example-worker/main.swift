import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import TokenBrokerClient
import TokenBrokerURLSession

// example-worker: calls a protected resource with a session's token through the broker,
// retrying once with a recovered token if the resource says the token is invalid.
//
//   example-worker [--socket PATH] --session NAME URL
//
// Against `tokenbroker serve --dev`:
//   example-worker --socket .build/run/tokenbroker.sock --session demo http://127.0.0.1:PORT/resource

var socket: String?
var session: String?
var url: URL?
var arguments = CommandLine.arguments.dropFirst()
while let argument = arguments.popFirst() {
    switch argument {
    case "--socket": socket = arguments.popFirst()
    case "--session": session = arguments.popFirst()
    case "-h", "--help":
        print("usage: example-worker [--socket PATH] --session NAME URL")
        exit(0)
    default: url = URL(string: argument)
    }
}
guard let session, let url else {
    FileHandle.standardError.write(Data("usage: example-worker [--socket PATH] --session NAME URL\n".utf8))
    exit(64)
}

let broker = TokenBrokerClient(socketPath: socket)
do {
    let (data, response) = try await broker.data(for: URLRequest(url: url), session: session)
    print("HTTP \(response.statusCode), \(data.count) bytes")
    exit(response.statusCode < 300 ? 0 : 1)
} catch let error as TokenBrokerError {
    FileHandle.standardError.write(Data("example-worker: \(error)\n".utf8))
    exit(1)
} catch {
    FileHandle.standardError.write(Data("example-worker: request failed: \(error.localizedDescription)\n".utf8))
    exit(1)
}
