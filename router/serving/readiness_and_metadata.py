"""What readiness, metadata, config and statistics answer: Triton's own answers for a
loaded model, the repository's config.pbtxt for one that is not.  These calls never load
or evict a model.

``Answers`` is given what it reads: the state (where models are, the repository), the
decision (``router.rollouts.routing_decisions.Decider``: which model a name means, its public name and
version) and the channels to Triton (``router.serving.triton_channels.Channels``)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from tritonclient.grpc import service_pb2

from domain.router_errors import (
    ModelUnavailable,
    RouterError,
    UnknownModel,
    UpstreamError,
    parse_version,
)
from domain.routes import Decision
from model_runtime.family.protocol import SLOTS_PARAMETER, STATUS_OUTPUT
from router.rollouts.routing_decisions import Decider
from router.serving.repository_config import FolderConfig, metadata_from_config, read_folder
from router.serving.serving_state import ServerAddress, ServingState
from router.serving.triton_channels import Channels

log = logging.getLogger(__name__)

BYTES_CACHE_MAX = 4096
CONFIG_CACHE_S = 5.0  # how long a model's config.pbtxt, read for a cold model, is reused


def hide_family_metadata(metadata: service_pb2.ModelMetadataResponse) -> None:
    """A variant's metadata is its family model's without the family's control output: a
    client cannot tell a variant from a model of its own."""
    kept = [o for o in metadata.outputs if o.name != STATUS_OUTPUT]
    if len(kept) != len(metadata.outputs):
        del metadata.outputs[:]
        metadata.outputs.extend(kept)


def hide_family_config(config) -> None:
    """A variant's config without the family's status output and slot count."""
    kept = [o for o in config.output if o.name != STATUS_OUTPUT]
    if len(kept) != len(config.output):
        del config.output[:]
        config.output.extend(kept)
    config.parameters.pop(SLOTS_PARAMETER, None)


class Answers:
    """Readiness, metadata, config and statistics: ``state`` says where a model is loaded
    (and where its repository is), ``decider`` which model a name means and by what name
    and version the client knows it, ``channels`` reach the Triton that holds it."""

    def __init__(self, state: ServingState, decider: Decider, channels: Channels):
        self.state = state
        self.decider = decider
        self.channels = channels
        self._configs: dict[str, tuple[float, FolderConfig | None]] = {}  # concrete -> (read at, config)

    def describe(self, asked: str, version: str = "", statistics: bool = False) -> Decision:
        """What readiness, metadata, config and statistics of ``asked`` (at ``version``,
        parsed) answer about.  Unknown names raise Triton's answer for the call."""
        try:
            if version:
                return self.decider.resolve(asked, None, version)
            return self.decider.decide_without_limits(asked)
        except UnknownModel as exc:
            raise (exc.for_statistics() if statistics else exc) from None

    def answering_server(self, asked: str, method: str, version: str = "") -> tuple[Decision, ServerAddress | None]:
        """What answers metadata / config / statistics of ``asked`` (``version`` parsed) and
        the server that holds it now; None: not loaded, and not loaded for this (statistics
        of a model that is not loaded are Triton's "unavailable")."""
        target = self.describe(asked, version, statistics=method == "statistics")
        server = self.state.ready_server(target.model)
        if server is None and method == "statistics":
            raise ModelUnavailable(asked)
        return target, server

    async def model_call(self, asked: str, method: str, version: str = ""):
        """Metadata / config / statistics of ``asked`` as Triton answers them, under the name
        and version the client asked for.  A model that is not loaded is not loaded for this:
        its metadata and config come from its config.pbtxt, its statistics are Triton's
        answer for a model it has not loaded."""
        target, server = self.answering_server(asked, method, parse_version(version))
        if server is None:
            return await self.cold_answer(asked, method, target)
        stub = self.channels.stub(server)
        _model, public_version = self.decider.public_identity(target)
        carrier = self.state.carrier_of(target.model)
        triton_model = carrier or target.model
        try:
            if method == "metadata":
                resp = await stub.ModelMetadata(service_pb2.ModelMetadataRequest(
                    name=triton_model, version=target.version))
                resp.name = asked
                if public_version is not None:
                    resp.versions[:] = [public_version]
                if carrier is not None:
                    hide_family_metadata(resp)
            elif method == "config":
                resp = await stub.ModelConfig(service_pb2.ModelConfigRequest(
                    name=triton_model, version=target.version))
                resp.config.name = asked
                if carrier is not None:
                    hide_family_config(resp.config)
            else:
                # A variant's statistics are its family model's (Triton counts per model).
                resp = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(
                    name=triton_model, version=target.version))
                for stats in resp.model_stats:
                    stats.name = asked
                    if public_version is not None:
                        stats.version = public_version
        except grpc.aio.AioRpcError as exc:
            raise UpstreamError(exc.code(), self.decider.public_text(exc.details() or "", target.model,
                                                                     asked, carrier)) from exc
        return resp

    async def all_statistics(self) -> service_pb2.ModelStatisticsResponse:
        """Statistics of every loaded model a client may name (Triton's answer when no model
        is named), under its public name and version."""
        out = service_pb2.ModelStatisticsResponse()
        for server in self.state.servers():
            try:
                resp = await self.channels.stub(server).ModelStatistics(service_pb2.ModelStatisticsRequest())
            except grpc.aio.AioRpcError as exc:
                log.debug("statistics of %s: %s", server.name, exc.details())
                continue
            names = self.decider.names
            for stats in resp.model_stats:
                public = names.public.get(stats.name) if names is not None else None
                if public is not None:
                    stats.name, stats.version = public
                elif names is not None and not names.expose_concrete:
                    continue  # an internal model
                out.model_stats.append(stats)
        return out

    async def cold_answer(self, asked: str, method: str, target: Decision):
        """Metadata or config of a model that is not loaded, from its repository folder."""
        carrier = self.state.carrier_of(target.model)
        found = await self._folder_config(carrier or target.model)
        if found is None:  # no config Triton could load: Triton's answer for an unloaded model
            raise UnknownModel(asked)
        _model, public_version = self.decider.public_identity(target)
        if method == "metadata":
            versions = [public_version] if public_version is not None else list(found.versions[-1:])
            response = metadata_from_config(found.config, asked, versions)
            if carrier is not None:
                hide_family_metadata(response)
            return response
        response = service_pb2.ModelConfigResponse()
        response.config.CopyFrom(found.config)
        response.config.name = asked
        if carrier is not None:
            hide_family_config(response.config)
        return response

    async def _folder_config(self, concrete: str) -> FolderConfig | None:
        """The model's config.pbtxt, read in a thread and kept for a few seconds (a burst
        of metadata calls reads the file once)."""
        cached = self._configs.get(concrete)
        now = time.monotonic()
        if cached is not None and now - cached[0] < CONFIG_CACHE_S:
            return cached[1]
        repository = self.state.repository
        if repository is None:
            return None
        found = await asyncio.to_thread(read_folder, repository / concrete)
        if len(self._configs) >= BYTES_CACHE_MAX:
            self._configs.clear()
        self._configs[concrete] = (now, found)
        return found

    def model_ready(self, asked: str, version: str = "") -> bool:
        """Ready = what ``asked`` is served by is loaded now; readiness never loads a model.
        Unknown names and versions are not ready (Triton's answer); a version that is not
        a number is refused (InvalidVersion)."""
        version = parse_version(version)
        try:
            target = self.describe(asked, version)
        except RouterError:
            return False
        return self.state.ready_server(target.model) is not None

    def any_server_up(self) -> bool:
        return any(s.up for s in self.state.servers())
