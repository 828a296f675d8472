"""Unmodified Triton clients of the router, over either protocol, as the end-to-end tests use
them: a demo customer's scores for given features within a deadline, and whether a Triton
itself holds a model."""

from __future__ import annotations

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def client_for(endpoints: dict, protocol: str, deadline_s: float):
    """A client of the router of ``endpoints`` (``mmctl endpoints --json``); over HTTP the
    client's own timeouts are the request's deadline."""
    if protocol == "grpc":
        return grpcclient.InferenceServerClient(endpoints["router_grpc"])
    return httpclient.InferenceServerClient(endpoints["router_http"], connection_timeout=deadline_s,
                                            network_timeout=deadline_s)


def infer_scores(client, protocol: str, model: str, features: np.ndarray,
                 deadline_s: float) -> np.ndarray:
    """A demo customer's SCORES for ``features`` (FEATURES, FP32)."""
    module = grpcclient if protocol == "grpc" else httpclient
    x = module.InferInput("FEATURES", list(features.shape), "FP32")
    x.set_data_from_numpy(features)
    if protocol == "grpc":
        return client.infer(model, [x], client_timeout=deadline_s).as_numpy("SCORES")
    return client.infer(model, [x]).as_numpy("SCORES")


def ready_on(http_url: str, model: str) -> bool:
    """Whether that Triton has ``model`` loaded, asked of Triton itself (not restricted)."""
    try:
        return requests.get(f"http://{http_url}/v2/models/{model}/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False
