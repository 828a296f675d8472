"""What readiness, metadata, config and statistics answer: Triton's own answers for a
loaded model, the repository's config.pbtxt for one that is not.  These calls never load
or evict a model.  Mixed into ``router.serving.core.Router``."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import grpc
from tritonclient.grpc import service_pb2

from control_plane.domain import errors as cp
from control_plane.domain.errors import ControlPlaneError
from model_runtime.family.protocol import SLOTS_PARAMETER, STATUS_OUTPUT
from router.rollouts.routes import ADAPTER_SEPARATOR, Decision, split_adapter
from router.serving.errors import (
    ModelUnavailable,
    RouterError,
    UnknownModel,
    UpstreamError,
    from_control_plane,
    parse_version,
)
from router.serving.repository_config import FolderConfig, metadata_from_config, read_folder
from router.serving.serving_state import ServerAddress

log = logging.getLogger(__name__)

BYTES_CACHE_MAX = 4096


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
CONFIG_CACHE_S = 5.0  # how long a model's config.pbtxt, read for a cold model, is reused


class Answers:
    """Needs ``table``, ``names``, ``state`` (router.serving_state) and ``stub(server)``."""

    def describe(self, asked: str, version: str = "", statistics: bool = False) -> Decision:
        """What readiness, metadata, config and statistics of ``asked`` (at ``version``,
        parsed) answer about.  Unknown names raise Triton's answer for the call."""
        try:
            if version:
                return self._resolve(asked, None, version)
            return self.decide_without_limits(asked)
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
        stub = self.stub(server)
        _model, public_version = self.public_identity(target)
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
            raise UpstreamError(exc.code(), self.public_text(exc.details() or "", target.model, asked,
                                                             carrier)) from exc
        return resp

    async def all_statistics(self) -> service_pb2.ModelStatisticsResponse:
        """Statistics of every loaded model a client may name (Triton's answer when no model
        is named), under its public name and version."""
        out = service_pb2.ModelStatisticsResponse()
        for server in self.state.servers():
            try:
                resp = await self.stub(server).ModelStatistics(service_pb2.ModelStatisticsRequest())
            except grpc.aio.AioRpcError as exc:
                log.debug("statistics of %s: %s", server.name, exc.details())
                continue
            for stats in resp.model_stats:
                public = self.names.public.get(stats.name) if self.names is not None else None
                if public is not None:
                    stats.name, stats.version = public
                elif self.names is not None and not self.names.expose_concrete:
                    continue  # an internal model
                out.model_stats.append(stats)
        return out

    async def cold_answer(self, asked: str, method: str, target: Decision):
        """Metadata or config of a model that is not loaded, from its repository folder."""
        carrier = self.state.carrier_of(target.model)
        found = await self._folder_config(carrier or target.model)
        if found is None:  # no config Triton could load: Triton's answer for an unloaded model
            raise UnknownModel(asked)
        _model, public_version = self.public_identity(target)
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

    def _resolve(self, name: str, user_id: str | None, version: str = "",
                 primary: bool = False) -> Decision:
        """The decision for ``name`` (``primary``: the deterministic one that readiness and
        metadata describe).  A name clients may not use, or an invalid one, is an unknown
        model, in Triton's words."""
        try:
            if version:
                return self._versioned(name, version)
            if primary:
                return Decision(name, self.table.primary(name), "default", scope=f"model:{name}")
            return self.table.resolve(name, user_id)
        except cp.InvalidModelName as exc:
            raise self._invalid_name(name, exc) from None
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from exc

    @staticmethod
    def _invalid_name(name: str, exc: cp.InvalidModelName) -> RouterError:
        """A name that cannot be a model: Triton's unknown model.  A malformed ``base:adapter``
        (the router's own syntax, no Triton answer to copy) says how to write it."""
        if ADAPTER_SEPARATOR in name:
            return from_control_plane(exc)
        return UnknownModel(name)

    def _versioned(self, name: str, version: str) -> Decision:
        """``name`` at registry version ``version``: that version's concrete model, outside
        experiments and canaries (the client chose it).  A route that is not a registry
        model has the version of what it serves."""
        base, adapter = split_adapter(name) if ADAPTER_SEPARATOR in name else (name, None)
        names = self.names
        if names is None:  # no registry: Triton's own versions
            return replace(self.table.resolve(name, None), version=version)
        concrete = names.by_version.get((base, version))
        if concrete is None:
            if base in self.table.routes:
                concrete = self.table.primary(base)
                if names.public.get(concrete, ("", ""))[1] != version:
                    raise UnknownModel(base, version)
            elif base in names.models:
                raise UnknownModel(base, version)
            elif names.expose_concrete:
                return replace(self.table.resolve(name, None), version=version)
            else:
                raise UnknownModel(base)
        return Decision(name, concrete, "default", scope=f"model:{name}", adapter=adapter)

    def decide_without_limits(self, logical: str) -> Decision:
        """What ``logical`` is answered by for readiness, metadata and health checks."""
        return self._resolve(logical, None, primary=True)

    def public_identity(self, decision: Decision) -> tuple[str, str | None]:
        """(model, version) by which a client knows the concrete model that served it: the
        registry's model and version when the client asked for a logical name; the concrete
        name and None (Triton's own version stands) for an exposed concrete name."""
        names = self.names
        if names is not None and not decision.version:
            base = decision.logical.partition(ADAPTER_SEPARATOR)[0]
            if base in names.models or base in self.table.routes:
                found = names.public.get(decision.model)
                if found is not None:
                    return found
        return decision.model, None

    @staticmethod
    def public_text(text: str, concrete: str, asked: str, carrier: str | None = None) -> str:
        """Triton's message about ``concrete`` (or ``carrier``, the family model serving it)
        as one about the model the client asked for (Triton quotes model names: 'simple.v2')."""
        if carrier is not None:
            text = text.replace(f"'{carrier}'", f"'{asked}'")
        if concrete == asked:
            return text
        return text.replace(f"'{concrete}'", f"'{asked}'")

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
