"""A plain grpc.aio pass-through proxy for ModelInfer (bytes in, bytes out), nothing else.

The floor for any Python gRPC hop on this machine: bench/router_latency.py measures it
beside the router so the router's own cost can be told apart from the transport's.

    python -m bench.passthrough_proxy LISTEN_ADDR TRITON_GRPC_ADDR
"""

import asyncio
import sys

import grpc

METHOD = "/inference.GRPCInferenceService/ModelInfer"


async def serve(listen: str, target: str) -> None:
    channel = grpc.aio.insecure_channel(target)
    forward = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)

    async def model_infer(raw: bytes, context) -> bytes:
        return await forward(raw)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)}),))
    server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
