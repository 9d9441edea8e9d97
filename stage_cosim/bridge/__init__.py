"""The gRPC bridge: synthesis, simulation and search as a service (``stage-cosim serve``).

``Client`` talks to a server; ``server.BridgeServer`` is one. The wire format is the versioned
protobuf package ``stagecosim.v1`` (``proto/stagecosim/v1/bridge.proto``).
"""

from stage_cosim.bridge.client import BridgeError, Client, JobFailed

__all__ = ["BridgeError", "Client", "JobFailed"]
