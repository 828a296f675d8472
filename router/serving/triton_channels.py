"""The router's gRPC channels to its Tritons: one per server, opened on first use, with
ModelInfer both on protobuf messages and on serialized bytes (the hot path never
re-serializes what it only passes through), and Triton's answer for a model it no longer
holds."""

from __future__ import annotations

import grpc
from tritonclient.grpc import service_pb2_grpc

from router.serving.serving_state import UNLOADED_PREFIX, ServerAddress

GRPC_MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
# A Triton restarted after a crash or a kill is reached again within a second, not after
# gRPC's default reconnect backoff (up to 120 s once a few connects failed).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                     ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


def unloaded_under(exc: grpc.aio.AioRpcError) -> bool:
    """Triton's answer for a model it no longer holds (unloaded between placement and send)."""
    return exc.code() == grpc.StatusCode.NOT_FOUND and (exc.details() or "").startswith(UNLOADED_PREFIX)


class Channels:
    """One gRPC channel to each Triton server, opened on first use, closed by ``close``."""

    def __init__(self) -> None:
        self._channels: dict[str, tuple[grpc.aio.Channel, service_pb2_grpc.GRPCInferenceServiceStub,
                                        object]] = {}

    def stub(self, server: ServerAddress) -> service_pb2_grpc.GRPCInferenceServiceStub:
        entry = self._channels.get(server.grpc_url)
        if entry is None:
            channel = grpc.aio.insecure_channel(server.grpc_url, options=[
                ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT_BYTES),
                ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT_BYTES),
                *RECONNECT_OPTIONS,
            ])
            # The raw ModelInfer callable sends and receives bytes: the router never
            # re-serializes a request or parses a response it only passes through.
            entry = self._channels[server.grpc_url] = (
                channel, service_pb2_grpc.GRPCInferenceServiceStub(channel),
                channel.unary_unary(INFER_METHOD, request_serializer=None, response_deserializer=None))
        return entry[1]

    def raw_infer(self, server: ServerAddress):
        """ModelInfer on ``server`` taking and returning serialized bytes."""
        entry = self._channels.get(server.grpc_url)
        if entry is None:
            self.stub(server)
            entry = self._channels[server.grpc_url]
        return entry[2]

    def typed_infer(self, server: ServerAddress):
        """ModelInfer on ``server`` taking and returning protobuf messages."""
        return self.stub(server).ModelInfer

    async def close(self) -> None:
        for channel, *_ in self._channels.values():
            await channel.close()
        self._channels.clear()
