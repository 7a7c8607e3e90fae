#if canImport(Glibc)
import Glibc
#endif
import TokenBrokerDaemon

// Synchronous on purpose: see TokenBrokerCommand.main.
exit(TokenBrokerCommand.main(Array(CommandLine.arguments.dropFirst())))
