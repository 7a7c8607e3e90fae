#if canImport(Glibc)
import Glibc
#endif
import Basics
import Varlink

// varlink-certification: the org.varlink.certification service and client on tokenbroker's
// varlink layer, for conformance tests against independent implementations.
//
//   varlink-certification serve  --varlink unix:PATH    serve until SIGTERM/SIGINT
//   varlink-certification client --varlink unix:PATH    run the client sequence; exit 0 if it passes

func printError(_ text: String) {
    let bytes = Array(text.utf8)
    _ = bytes.withUnsafeBytes { write(2, $0.baseAddress, $0.count) }
}

let usage = "usage: varlink-certification serve|client --varlink unix:PATH\n"
let arguments = Array(CommandLine.arguments.dropFirst())
guard arguments.count == 3, ["serve", "client"].contains(arguments[0]), arguments[1] == "--varlink",
      let address = VarlinkAddress(arguments[2]) else {
    printError(usage)
    exit(64)
}

if arguments[0] == "client" {
    do {
        try CertificationClient(client: VarlinkClient(address: address, timeout: 10)).run()
        exit(0)
    } catch {
        printError("Certification failed: \(error)\n")
        exit(1)
    }
}

do {
    unlink(address.path)
    let fd = try UnixSocket.listen(path: address.path)
    let server = try VarlinkServer(listening: fd,
                                   info: VarlinkServiceInfo(vendor: "tokenbroker", product: "varlink-certification",
                                                            version: "1", url: "https://github.com/varlink"),
                                   interfaces: [Certification.interface], handler: CertificationService())
    server.start()
    print("Listening on \(address)")
    waitForTerminationSignal()
    unlink(address.path)
    exit(0)
} catch {
    printError("varlink-certification: \(error)\n")
    exit(1)
}
