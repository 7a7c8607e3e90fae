import Testing
@testable import TokenBrokerCore

/// Register always comes first (the actor does it); park, cancel and resolve may then happen in
/// any order. Each order must resume the caller exactly once (a double resume would trap the
/// checked continuation), with the outcome of whichever of cancel and resolve came first.
@Suite("WaiterTable")
struct WaiterTableTests {
    static let orders: [[String]] = [
        ["park", "cancel", "resolve"], ["park", "resolve", "cancel"], ["cancel", "park", "resolve"],
        ["cancel", "resolve", "park"], ["resolve", "park", "cancel"], ["resolve", "cancel", "park"],
    ]

    @Test("every order of park, cancel and resolve resumes once")
    func everyOrder() async throws {
        for order in Self.orders {
            let table = WaiterTable()
            let flight = FlightID(1)
            let token = IssuedToken(token: Secret("t"), tokenType: "Bearer", expiresAt: nil, generation: 1, serial: 1)
            table.register(1, on: flight)
            var outcome: Result<IssuedToken, any Error>?
            do {
                let value = try await withCheckedThrowingContinuation { continuation in
                    // Everything before "park" happens before the continuation exists; the rest after.
                    let parkAt = order.firstIndex(of: "park")!
                    for step in order[..<parkAt] { Self.apply(step, table, flight, token) }
                    table.park(1, continuation)
                    for step in order[(parkAt + 1)...] { Self.apply(step, table, flight, token) }
                }
                outcome = .success(value)
            } catch {
                outcome = .failure(error)
            }
            if order.first(where: { $0 != "park" }) == "cancel" {
                #expect(outcome?.error is CancellationError, "\(order)")
            } else {
                #expect(outcome?.value?.serial == 1, "\(order)")
            }
            #expect(table.count == 0, "\(order)")
        }
    }

    static func apply(_ step: String, _ table: WaiterTable, _ flight: FlightID, _ token: IssuedToken) {
        if step == "cancel" { table.cancel(1) } else { table.resolve(flight, with: .success(token)) }
    }
}
