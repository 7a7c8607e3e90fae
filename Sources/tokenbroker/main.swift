#if canImport(Glibc)
import Glibc
#endif
import Basics
import TokenBrokerCLI

// The small, static `tokenbroker`: help, --version and ctl here; serve and check-config in
// tokenbroker-daemon, which this process becomes (see Command).
var output = FileOutput.standardOutput
var errors = FileOutput.standardError
// (Started as `docker-credential-tokenbroker` and the like: that helper.)
let arguments = Command.processArguments()
// A login on a terminal may draw a QR code, with a library only a dynamically linked process
// loads (QRCode): it runs in tokenbroker-daemon (here, without the code, if that cannot start).
// (check-config comes back from Command.run, and fails with its reason if it cannot start.)
if Command.prefersDaemon(arguments, terminal: isatty(STDOUT_FILENO) == 1) {
    var quiet = ""
    _ = DaemonExecutable.exec("ctl", Array(arguments.dropFirst()), errors: &quiet)
}
switch Command.run(arguments, output: &output, errors: &errors) {
case let .exit(code):
    exit(code)
case let .daemon(subcommand, arguments):
    exit(DaemonExecutable.exec(subcommand, arguments, errors: &errors))
}
