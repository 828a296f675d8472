"""Copies of a model, driven as an operator does: `mmctl scale` on `mmctl up --triton-servers 2`
puts a copy on each real tritonserver, unmodified Triton clients' requests through the
router are answered by both (Triton's own statistics count them), a SIGKILLed server's copy
is placed again with no client error (and what the killed server left, its python stubs, ends
with its restart), and `mmctl unload` unloads every copy."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from safetensors.torch import load_file

from control_plane.demo.fleet import (
    DEMO_FAMILY,
    WEIGHTS_FILE,
    FleetSpec,
    base_weights,
    customer_weights,
    generate_family_fleet,
)
from tests.conftest import pid_alive
from tests.product import Product
from tests.reference import mlp_scores
from tests.router_clients import client_for, infer_scores, ready_on
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

MODEL = "cust001"
VARIANT = "fam001"  # a variant of the demo's model family, in the same repository
VARIANT_SPEC = FleetSpec(count=2, hidden_dim=32, hidden_layers=1, prefix="fam")
DEADLINE_S = 30.0
FEATURES = np.random.default_rng(31).standard_normal((2, 64)).astype(np.float32)


def inferences_on(http_url: str, model: str = MODEL) -> int:
    """Successful inferences of ``model`` that Triton itself counted (0 when not loaded)."""
    try:
        body = requests.get(f"http://{http_url}/v2/models/{model}/stats", timeout=5).json()
    except (requests.RequestException, ValueError):
        return 0
    return sum(int(s["inference_stats"]["success"]["count"]) for s in body.get("model_stats", []))


def family_inferences_on(http_url: str) -> int:
    """Inferences of the family's Triton model on one server (its variants' requests)."""
    return inferences_on(http_url, DEMO_FAMILY)


def group_of(pid: int) -> list[int]:
    """The other processes of ``pid``'s process group (a tritonserver's python stubs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != pid:
            try:
                if os.getpgid(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except ProcessLookupError:
                pass
    return found




def test_scale_spreads_requests_over_copies_and_a_killed_servers_copy_comes_back(repository, tmp_path):
    generate_family_fleet(repository, VARIANT_SPEC)  # beside the models of their own
    variant_expected = mlp_scores(customer_weights(VARIANT_SPEC, VARIANT, base_weights(VARIANT_SPEC)),
                                  FEATURES)
    product = Product(tmp_path / "state", repository, "--triton-servers", "2", "--fleet-size", "0",
                      "--router-workers", "1", "--max-loaded", "4").start()
    try:
        endpoints = product.json("endpoints")
        tritons = {t["server"]: t for t in endpoints["triton"]}
        http_of = {name: t["http"].removeprefix("http://") for name, t in tritons.items()}
        expected = mlp_scores(load_file(str(repository / MODEL / "1" / WEIGHTS_FILE)), FEATURES)
        logs = lambda: product.log_text()[-4000:]

        # Bad input first: nothing is loaded for it.
        too_many = product.mmctl("scale", MODEL, "--replicas", "3")
        assert too_many.returncode == 2, too_many.stderr
        assert "the fleet has 2 server(s)" in too_many.stderr and "--triton-servers" in too_many.stderr
        assert product.mmctl("scale", MODEL, "--replicas", "0").returncode == 2
        unknown = product.mmctl("scale", "nosuch", "--replicas", "2")
        assert unknown.returncode == 4 and "unknown model 'nosuch'" in unknown.stderr
        assert not any(ready_on(url, MODEL) for url in http_of.values())

        scaled = product.mmctl("scale", MODEL, "--replicas", "2")
        assert scaled.returncode == 0, scaled.stderr
        assert scaled.stdout.startswith(f"{MODEL}: 2 of 2 copies ready on "), scaled.stdout
        assert all(ready_on(url, MODEL) for url in http_of.values())
        row = product.json("status", MODEL)[0]
        assert row["replicas"] == 2
        assert sorted((c["server"], c["state"]) for c in row["copies"]) == [
            (name, "ready") for name in sorted(tritons)]
        own = row["server"]
        other = next(name for name in tritons if name != own)
        fleet = {s["server"]: s for s in product.json("fleet")}
        assert MODEL in fleet[own]["loaded"] and f"{MODEL}#{other}" in fleet[other]["loaded"]

        errors: list[str] = []
        answered = [0]
        stop = threading.Event()

        def traffic(protocol: str) -> None:
            client = client_for(endpoints, protocol, DEADLINE_S)
            try:
                while not stop.is_set():
                    sent = time.monotonic()
                    try:
                        scores = infer_scores(client, protocol, MODEL, FEATURES, DEADLINE_S)
                        np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
                        answered[0] += 1
                    except Exception as exc:  # noqa: BLE001  (every failure is the test's finding)
                        errors.append(f"{protocol} after {time.monotonic() - sent:.1f}s: "
                                      f"{type(exc).__name__}: {exc}")
            finally:
                client.close()

        threads = [threading.Thread(target=traffic, args=(p,)) for p in ("grpc", "grpc", "http", "http")]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: answered[0] >= 200 or errors, 60, "200 requests were not answered", logs)
            # Both copies serve: the least-loaded choice spreads the requests over them.  (How
            # evenly depends on how fast each answers, which the unit tests beside this one
            # make uneven on two cores: the faster copy rightly gets more.  The unit tests of
            # ``least_loaded`` check the split itself.)
            counts: dict[str, int] = {}

            def both_served() -> bool:
                counts.update({name: inferences_on(url) for name, url in http_of.items()})
                return all(n >= 30 for n in counts.values()) or bool(errors)

            wait_for(both_served, 60, "both copies serving 30 requests",
                     lambda: f"Triton's counts: {counts}\n{logs()}")

            # SIGKILL the server of the model's own copy under traffic: its copy elsewhere is
            # the model's own at once, and the killed Triton, started again, gets a copy back.
            pid = next(p["pid"] for p in endpoints["processes"]
                       if p.get("role") == "triton" and p.get("name") == own)
            before = answered[0]
            stubs = group_of(pid)  # its python-backend stubs: they hold the models' memory
            assert stubs, f"tritonserver {pid} has no python-backend stub"
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not pid_alive(pid), 10, "the killed tritonserver did not exit", logs)
            wait_for(lambda: product.json("status", MODEL)[0]["server"] == other, DEADLINE_S,
                     f"{MODEL}'s copy on {other} did not become its own", logs)
            wait_for(lambda: sorted(c["server"] for c in product.json("status", MODEL)[0]["copies"]
                                    if c["state"] == "ready") == sorted(tritons),
                     60, f"{MODEL} did not get its copy on {own} back", logs)
            wait_for(lambda: answered[0] >= before + 100 or errors, 60,
                     "requests were not answered after the kill", logs)
            # What the killed server left (its stubs) ended with its restart.
            wait_for(lambda: not any(pid_alive(p) for p in stubs), 10,
                     f"the killed tritonserver's stubs {stubs} outlived it", logs)
        finally:
            stop.set()
            for t in threads:
                t.join(DEADLINE_S + 5)
        assert errors == [], errors[:5]
        print(f"answered {answered[0]} requests, 0 errors; before the kill: {counts}")

        # Unload: every copy goes (the target stays for its next load).
        unloaded = product.mmctl("unload", MODEL)
        assert unloaded.returncode == 0, unloaded.stderr
        wait_for(lambda: not any(ready_on(url, MODEL) for url in http_of.values()), 30,
                 f"{MODEL} stayed loaded somewhere", logs)
        row = product.json("status", MODEL)[0]
        assert (row["state"], row["copies"], row["replicas"]) == ("warm", [], 2)

        # A family's variant: each copy takes a slot of the family's model on its server,
        # and requests for it are answered from both (the family model's own statistics).
        scaled = product.mmctl("scale", VARIANT, "--replicas", "2")
        assert scaled.returncode == 0, scaled.stderr
        assert sorted(c["server"] for c in product.json("status", VARIANT)[0]["copies"]
                      if c["state"] == "ready") == sorted(tritons)
        client = client_for(endpoints, "grpc", DEADLINE_S)
        try:
            for _ in range(40):
                np.testing.assert_allclose(infer_scores(client, "grpc", VARIANT, FEATURES, DEADLINE_S),
                                           variant_expected, rtol=1e-5, atol=1e-6)
        finally:
            client.close()
        served = {name: family_inferences_on(url) for name, url in http_of.items()}
        assert all(n > 0 for n in served.values()), served
        unloaded = product.mmctl("unload", VARIANT)
        assert unloaded.returncode == 0, unloaded.stderr
        assert product.json("status", VARIANT)[0]["copies"] == []
    finally:
        product.stop()
    product.assert_no_triton_left()
