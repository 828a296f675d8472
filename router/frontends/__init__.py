"""The public ports: Triton's gRPC service and KServe v2 HTTP, request checks, system shared memory."""
