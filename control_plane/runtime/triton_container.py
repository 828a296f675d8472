"""The Triton container's entry point (docker/Dockerfile.triton): ``tritonserver`` with the
flags every Triton of the product runs with (``launch.triton_args``), on the container's
addresses, its restricted APIs behind the key the control plane holds, logging to stdout.

    python -m control_plane.runtime.triton_container serve --repository /models --key-file /keys/triton.key
    python -m control_plane.runtime.triton_container share-key --state-key /state/triton.key --triton-key /keys/triton.key
    python -m control_plane.runtime.triton_container wait-live --url http://triton:8100/v2/health/live
    python -m control_plane.runtime.triton_container tritonserver --model-repository=/models ...

The last runs tritonserver with the arguments given, as NGC's image runs a container's
``tritonserver ...`` arguments: the Helm chart's Triton pods start this image or NGC's alike.

The binary is the one on PATH (the NGC image) or the nvidia-pytriton wheel's (the CPU image,
with the python backend assembled as ``mmctl up`` assembles it).  Exec'd, so the container's
signals reach tritonserver itself."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from control_plane.triton.launch import (
    TritonLaunchConfig,
    build_backend_dir,
    printable_command,
    pytriton_root,
    triton_args,
    triton_environment,
)

# Where the CPU image assembles the python backend: /tmp is writable under a read-only root
# (the chart mounts an emptyDir there).
WORK_DIR = Path("/tmp/triton")


def read_key(path: Path, wait_s: float = 0.0) -> str:
    """The restricted-API key in ``path``, waited for up to ``wait_s`` (the control plane's
    container writes it as it starts); exits naming what is wrong when there is none."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            key = path.read_text().strip()
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                sys.exit(f"no Triton key file at {path} after {wait_s:.0f}s: the control plane's "
                         "container writes it (share-key) as it starts")
            time.sleep(0.5)
        except OSError as exc:
            sys.exit(f"cannot read the Triton key file {path}: {exc.strerror}")
    if len(key) < 16:
        sys.exit(f"the Triton key in {path} is {'empty' if not key else 'too short'}: it "
                 "needs 16 characters or more (key-init writes a random one)")
    return key


def share_key(state_key: Path, triton_key: Path) -> None:
    """The key the control plane keeps in its state directory (MMS_TRITON_ADMIN_KEY when
    set, else the one kept, else a new one: ``ensure_secret_file``), and a copy of it in
    ``triton_key``, in a volume of Triton's own: Triton's container never mounts the state."""
    from control_plane.state.secret_files import ensure_secret_file

    key = ensure_secret_file(state_key, os.environ.get("MMS_TRITON_ADMIN_KEY") or None,
                             what="Triton key", min_chars=16, setting="MMS_TRITON_ADMIN_KEY")
    ensure_secret_file(triton_key, key, what="Triton key")


def wait_live(url: str, timeout_s: float) -> bool:
    """Until Triton at ``url`` answers live, at most ``timeout_s``: the control plane's
    container starts once the models Triton's container writes first (``--demo-fleet``) are
    in the repository, which the control plane reads as it starts.  False (said on stderr)
    when it did not answer: the control plane starts anyway and watches for it."""
    import requests

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() >= deadline:
            print(f"Triton at {url} was not live after {timeout_s:.0f}s; starting without it",
                  file=sys.stderr, flush=True)
            return False
        time.sleep(0.5)


def binary_and_backends(work_dir: Path) -> tuple[Path, Path]:
    """The image's tritonserver and its backends' folder."""
    on_path = shutil.which("tritonserver")
    if on_path:  # NGC: the backends lie beside the binary's folder
        binary = Path(on_path)
        return binary, binary.resolve().parent.parent / "backends"
    return pytriton_root() / "bin" / "tritonserver", build_backend_dir(work_dir / "backends")


def as_given(argv: list[str], work_dir: Path) -> list[str]:
    """``tritonserver ARGV``, with the backends' folder added unless ARGV names one (the
    CPU image assembles the python backend's, as ``mmctl up`` does)."""
    binary, backend_dir = binary_and_backends(work_dir)
    if any(arg.startswith("--backend-directory") for arg in argv):
        return [str(binary), *argv]
    return [str(binary), f"--backend-directory={backend_dir}", *argv]


def command(args: argparse.Namespace) -> list[str]:
    cfg = TritonLaunchConfig(repository=args.repository, work_dir=args.work_dir, host=args.host,
                             http_port=args.http_port, grpc_port=args.grpc_port,
                             metrics_port=args.metrics_port,
                             restricted_key=read_key(args.key_file, args.key_wait_s))
    binary, backend_dir = binary_and_backends(args.work_dir)
    return [str(binary), *triton_args(cfg, backend_dir, None)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tritonserver"]:
        WORK_DIR.mkdir(parents=True, exist_ok=True)
        _exec(as_given(argv[1:], WORK_DIR))
        return
    parser = argparse.ArgumentParser(prog="python -m control_plane.runtime.triton_container",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="exec tritonserver")
    serve.add_argument("--repository", type=Path, required=True)
    serve.add_argument("--key-file", type=Path, required=True,
                       help="the key of Triton's restricted APIs (model control, shared memory)")
    serve.add_argument("--host", default="0.0.0.0",
                       help="the container's addresses: reached only on its internal network")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--work-dir", type=Path, default=WORK_DIR)
    serve.add_argument("--key-wait-s", type=float, default=300.0,
                       help="how long to wait for the key file to appear")
    serve.add_argument("--demo-fleet", type=int, default=0, metavar="N",
                       help="first write the demo mmctl up serves (N customers as one family, the "
                            "rollout and LoRA demos) where missing; 0: serve the repository as it is")
    shared = commands.add_parser("share-key", help="the control plane's Triton key, and Triton's copy")
    shared.add_argument("--state-key", type=Path, required=True)
    shared.add_argument("--triton-key", type=Path, required=True)
    live = commands.add_parser("wait-live", help="wait until Triton answers live")
    live.add_argument("--url", required=True)
    live.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.command == "wait-live":
        wait_live(args.url, args.timeout_s)
        return
    if args.command == "share-key":
        share_key(args.state_key, args.triton_key)
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.demo_fleet:
        from control_plane.demo import write_demo_repository

        write_demo_repository(args.repository, args.demo_fleet, layout="family")
    _exec(command(args))


def _exec(cmd: list[str]) -> None:
    print("starting tritonserver:", printable_command(cmd), flush=True)
    os.execve(cmd[0], cmd, triton_environment(os.environ))


if __name__ == "__main__":
    main()
