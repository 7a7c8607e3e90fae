import BrokerContract
import TokenBrokerCore

extension StatusEntry {
    /// A session as its coordinator reports it (the contract knows nothing of the core).
    init(_ status: SessionStatus) {
        self.init(name: status.name, state: status.state.rawValue, generation: status.generation)
        (tokenSerial, expiresAt, lastRefresh) = (status.tokenSerial, status.expiresAt, status.lastRefresh)
        (refreshing, backoffRemaining) = (status.refreshing, status.backoffRemaining?.seconds)
        (lastError, degraded) = (status.lastError, status.degraded)
        let counted = status.counters
        (counters[.fetches], counters[.joinedWaiters], counters[.failures]) = (counted.fetches, counted.joinedWaiters, counted.failures)
        (counters[.staleRejections], counters[.throttled], counters[.droppedResults]) = (counted.staleRejections, counted.throttled, counted.droppedResults)
        throttledUsers = status.throttled.filter { $0.delegation == 0 }.map(\.uid)
        derivations = counted.derivations > 0 ? counted.derivations : nil
    }
}
