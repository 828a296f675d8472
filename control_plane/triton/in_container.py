"""The Triton container's entry point (docker/Dockerfile.triton): ``tritonserver`` with the
flags every Triton of the product runs with (``launch.triton_args``), on the container's
addresses, its restricted APIs behind the key the control plane holds, logging to stdout.

    python -m control_plane.triton.in_container --repository /models --key-file /state/triton.key

The binary is the one on PATH (the NGC image) or the nvidia-pytriton wheel's (the CPU image,
with the python backend assembled as ``mmctl up`` assembles it).  Exec'd, so the container's
signals reach tritonserver itself."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from control_plane.triton.launch import (
    TritonLaunchConfig,
    build_backend_dir,
    printable_command,
    pytriton_root,
    triton_args,
    triton_environment,
)


def read_key(path: Path) -> str:
    """The restricted-API key in ``path``; exits naming what is wrong when there is none."""
    try:
        key = path.read_text().strip()
    except OSError as exc:
        sys.exit(f"cannot read the Triton key file {path}: {exc.strerror}; the key-init "
                 "service writes it into the state volume")
    if len(key) < 16:
        sys.exit(f"the Triton key in {path} is {'empty' if not key else 'too short'}: it "
                 "needs 16 characters or more (key-init writes a random one)")
    return key


def command(args: argparse.Namespace) -> list[str]:
    cfg = TritonLaunchConfig(repository=args.repository, work_dir=args.work_dir, host=args.host,
                             http_port=args.http_port, grpc_port=args.grpc_port,
                             metrics_port=args.metrics_port, restricted_key=read_key(args.key_file))
    on_path = shutil.which("tritonserver")
    if on_path:  # NGC: the backends lie beside the binary's folder
        binary = Path(on_path)
        backend_dir = binary.resolve().parent.parent / "backends"
    else:
        binary = pytriton_root() / "bin" / "tritonserver"
        backend_dir = build_backend_dir(args.work_dir / "backends")
    return [str(binary), *triton_args(cfg, backend_dir, None)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m control_plane.triton.in_container",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--key-file", type=Path, required=True,
                        help="the key of Triton's restricted APIs (model control, shared memory)")
    parser.add_argument("--host", default="0.0.0.0",
                        help="the container's addresses: reached only on its internal network")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/triton"))
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cmd = command(args)
    print("starting tritonserver:", printable_command(cmd), flush=True)
    os.execve(cmd[0], cmd, triton_environment(os.environ))


if __name__ == "__main__":
    main()
