#if canImport(Glibc)
import Glibc
#endif
import Basics
import CLinux
import Synchronization

/// `org.varlink.service`, which every varlink service implements.
extension VarlinkServer {
    func serviceReply(_ call: VarlinkCall) -> VarlinkReply {
        let parameters = Parameters(call.parameters)
        switch call.member {
        case "GetInfo":
            do { try parameters.only([]) } catch { return error.reply }
            let names = ["org.varlink.service"] + interfaces.map(\.name)
            return VarlinkReply(parameters: [
                "vendor": .string(info.vendor), "product": .string(info.product), "version": .string(info.version),
                "url": .string(info.url), "interfaces": .array(names.map(JSON.string)),
            ])
        case "GetInterfaceDescription":
            let name: String
            do {
                try parameters.only(["interface"])
                name = try parameters.string("interface")
            } catch {
                return error.reply
            }
            if name == "org.varlink.service" { return VarlinkReply(parameters: ["description": .string(Self.serviceDescription)]) }
            guard let interface = interfaces.first(where: { $0.name == name }) else {
                return .error(VarlinkServiceError.interfaceNotFound, ["interface": .string(name)])
            }
            return VarlinkReply(parameters: ["description": .string(interface.description)])
        default:
            return .error(VarlinkServiceError.methodNotFound, ["method": .string(call.method)])
        }
    }

    /// The standard interface every varlink service implements.
    public static let serviceDescription = """
        # The Varlink Service Interface is provided by every varlink service. It
        # describes the service and the interfaces it implements.
        interface org.varlink.service

        # Get a list of all the interfaces a service provides and information
        # about the implementation.
        method GetInfo() -> (
          vendor: string,
          product: string,
          version: string,
          url: string,
          interfaces: []string
        )

        # Get the description of an interface that is implemented by this service.
        method GetInterfaceDescription(interface: string) -> (description: string)

        # The requested interface was not found.
        error InterfaceNotFound (interface: string)

        # The requested method was not found
        error MethodNotFound (method: string)

        # The interface defines the requested method, but the service does not
        # implement it.
        error MethodNotImplemented (method: string)

        # One of the passed parameters is invalid.
        error InvalidParameter (parameter: string)

        # Client is denied access
        error PermissionDenied ()

        # Method is expected to be called with 'more' set to true, but wasn't
        error ExpectedMore ()

        """
}
