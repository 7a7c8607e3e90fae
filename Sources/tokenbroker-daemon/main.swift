#if canImport(Glibc)
import Glibc
#endif
import TokenBrokerDaemon
import TokenBrokerDaemonCommand
import TokenBrokerDevelopment

// Synchronous on purpose: see TokenBrokerCommand.main.
exit(TokenBrokerCommand.main(Array(CommandLine.arguments.dropFirst()), development: { try DevelopmentSetup() }))
