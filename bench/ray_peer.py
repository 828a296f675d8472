"""A peer for the benchmarks: Ray Serve's model multiplexing over the same variants' weights.

What a platform team would build with Ray Serve instead: one replica that keeps up to
``room`` variants in memory (``@serve.multiplexed``, least recently used evicted) and loads a
missing one from its weights file, in one process, no Triton.  The benches run it beside the
product on the same files, the same clients' pattern and the same machine, and check its
answers against the same references.

The bench process imports this module for ``RayPeer`` (the peer's process and an HTTP client
for it); the peer's process runs this file as a script with the Python of its own virtual
environment (``.venv-peers/ray``, made on first use with ``PEER_REQUIREMENTS``): Ray pins its
own versions of libraries the product also uses, so it never shares the product's ``.venv``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-peers" / "ray"
PEER_REQUIREMENTS = ["ray[serve]==2.60.0", "torch==2.13.0", "safetensors==0.8.0", "numpy==2.4.6"]
MODEL_ID_HEADER = "serve_multiplexed_model_id"  # Ray Serve's header naming the model
REPLICA_PROCESS = "^ray::ServeReplica"  # the replica's command line (a pgrep pattern)


def peer_python() -> Path:
    """The peer environment's Python, made (once, about a minute and 1.4 GB) when missing."""
    python = PEER_VENV / "bin" / "python"
    marker = PEER_VENV / ".installed"
    wanted = "\n".join(PEER_REQUIREMENTS)
    if marker.is_file() and marker.read_text() == wanted:
        return python
    print(f"ray peer: installing {', '.join(PEER_REQUIREMENTS)} into {PEER_VENV} (once)", flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_REQUIREMENTS], check=True)
    marker.write_text(wanted)
    print(f"ray peer: installed in {time.perf_counter() - started:.0f}s", flush=True)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayPeer:
    """The peer's process serving ``weights_dir/<variant>/<weights_file>`` with ``room`` in
    memory, on a loopback port; ``client()`` talks to it as the benches' clients do."""

    def __init__(self, weights_dir: Path, weights_file: str, room: int, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [str(peer_python()), __file__, "--weights-dir", str(weights_dir), "--weights-file",
             weights_file, "--room", str(room), "--port", str(self.port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        deadline = time.monotonic() + 180
        line = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            line = self.proc.stdout.readline().strip()
            if line == "ready":
                return
        self.close()
        raise RuntimeError(f"the Ray Serve peer did not start (last line {line!r}; see {log_path})")

    def client(self, timeout_s: float) -> PeerClient:
        return PeerClient(self.url, timeout_s)

    def loads(self) -> int:
        """Variants the replica loaded so far (its misses)."""
        import requests

        return int(requests.get(self.url + "/loads", timeout=10).json()["loads"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the peer shuts Ray down when its stdin closes
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class PeerClient:
    """One HTTP session to the peer, one request at a time, as an application holds one."""

    def __init__(self, url: str, timeout_s: float):
        import requests

        self.url = url
        self.timeout_s = timeout_s
        self.session = requests.Session()

    def infer(self, model: str, features):
        import numpy as np

        answer = self.session.post(self.url + "/", json={"features": features.tolist()},
                                   headers={MODEL_ID_HEADER: model}, timeout=self.timeout_s)
        answer.raise_for_status()
        return np.asarray(answer.json()["scores"], np.float32)

    def close(self) -> None:
        self.session.close()


def serve(weights_dir: Path, weights_file: str, room: int, port: int) -> None:
    """Run the peer until stdin closes (in the peer environment)."""
    import ray
    import torch
    from ray import serve
    from safetensors.torch import load_file
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    def forward(weights: dict, x: torch.Tensor) -> torch.Tensor:
        """The demo recommender: relu hidden layers, sigmoid score."""
        layers = len([k for k in weights if k.endswith(".weight")])
        with torch.inference_mode():
            for i in range(layers):
                x = torch.nn.functional.linear(x, weights[f"layers.{i}.weight"], weights[f"layers.{i}.bias"])
                x = torch.relu(x) if i < layers - 1 else torch.sigmoid(x)
        return x

    @serve.deployment(max_ongoing_requests=64)
    class Variants:
        def __init__(self):
            self.loads = 0

        @serve.multiplexed(max_num_models_per_replica=room)
        async def get_model(self, model_id: str) -> dict:
            self.loads += 1
            return await asyncio.to_thread(load_file, str(weights_dir / model_id / weights_file))

        async def __call__(self, request: Request):
            if request.url.path.rstrip("/").endswith("loads"):
                return JSONResponse({"loads": self.loads})
            weights = await self.get_model(serve.get_multiplexed_model_id())
            x = torch.tensor((await request.json())["features"], dtype=torch.float32)
            scores = await asyncio.to_thread(forward, weights, x)
            return JSONResponse({"scores": scores.tolist()})

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Variants.bind(), route_prefix="/", blocking=False)
    print("ready", flush=True)
    sys.stdin.read()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the Ray Serve peer's process (run by RayPeer)")
    ap.add_argument("--weights-dir", type=Path, required=True)
    ap.add_argument("--weights-file", required=True)
    ap.add_argument("--room", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    cli = ap.parse_args()
    serve(cli.weights_dir, cli.weights_file, cli.room, cli.port)
