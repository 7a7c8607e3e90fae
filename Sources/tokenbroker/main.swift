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
let arguments = Command.arguments(invokedAs: CommandLine.arguments.first ?? "", Array(CommandLine.arguments.dropFirst()))
switch Command.run(arguments, output: &output, errors: &errors) {
case let .exit(code):
    exit(code)
case let .daemon(subcommand, arguments):
    exit(DaemonExecutable.exec(subcommand, arguments, errors: &errors))
}
