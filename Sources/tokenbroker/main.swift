#if canImport(Glibc)
import Glibc
#endif
import TokenBrokerDaemon

exit(await TokenBrokerCommand.run(Array(CommandLine.arguments.dropFirst())))
