"""A plain pass-through proxy for ModelInfer (bytes in, bytes out), nothing else.

The floor for any Python gRPC hop on this machine: bench/router_latency.py measures it
beside the router so the router's own cost can be told apart from the transport's.  Two
transports: grpc.aio (the router's) and, with --sync, grpc's thread-pool server and a
blocking channel (the other one Python's grpc offers).

    python -m bench.passthrough_proxy LISTEN_ADDR TRITON_GRPC_ADDR [--sync]
"""

import asyncio
import sys
from concurrent import futures

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


def serve_sync(listen: str, target: str) -> None:
    channel = grpc.insecure_channel(target)
    forward = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)

    def model_infer(raw: bytes, context) -> bytes:
        return forward(raw)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)}),))
    server.add_insecure_port(listen)
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    if "--sync" in sys.argv[3:]:
        serve_sync(sys.argv[1], sys.argv[2])
    else:
        asyncio.run(serve(sys.argv[1], sys.argv[2]))
