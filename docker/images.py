"""Build the product's two images with this machine's engine (podman, else docker): `make images`.

    python docker/images.py [--base IMAGE] [--engine podman|docker] [--gpu]

* ``mmserve``: the control plane, the router and mmctl (docker/Dockerfile): no torch, no
  Triton, no compilers, a non-root user.
* ``mmserve-triton``: Triton and what its models import (docker/Dockerfile.triton): on CPU
  the ``tritonserver`` and python backend of the nvidia-pytriton wheel ``make up`` uses; with
  ``--gpu``, NGC's Triton image with torch added.

Both install from a folder of wheels made here by pip (the product's own wheel and every
dependency at the versions of constraints.txt, resolved with this machine's pip settings),
so a build reaches no package index and needs no certificate of this machine's.  The base
is a build argument: ``--base``, else the registry's ``python:3.11-slim`` where a registry
answers, else a Debian base made here with debootstrap (root) and imported once.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "build" / "images" / "wheels"
CONTAINERS_CONF = ROOT / "docker" / "podman" / "containers.conf"
REGISTRY_BASE = "docker.io/library/python:3.11-slim"
LOCAL_BASE = "localhost/mms-debian-base:bookworm"
GPU_BASE = "nvcr.io/nvidia/tritonserver:24.10-py3"
CONTROL_PLANE_IMAGE = "localhost/mmserve"
TRITON_IMAGE = "localhost/mmserve-triton"
PULL_TIMEOUT_S = 120


class BuildError(RuntimeError):
    pass


def engine_env(engine: str) -> dict[str, str]:
    """The environment an engine runs in: podman with the project's containers.conf (runc
    on cgroupfs, the host's ulimits) unless the caller set one of its own."""
    env = dict(os.environ)
    if Path(engine).name == "podman":
        env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def find_engine(asked: str | None = None) -> str:
    for name in ([asked] if asked else ["podman", "docker"]):
        found = shutil.which(name)
        if found:
            return found
    raise BuildError(f"no container engine: {'no ' + asked if asked else 'neither podman nor docker'} "
                     f"on PATH; on Debian: apt-get install podman runc {PODMAN_NETWORK_PACKAGES} "
                     "(see docs/deployment.md)")


# Where Debian's podman finds netavark and aardvark-dns, and where iptables is (/usr/sbin is
# not on every user's PATH).
PODMAN_HELPER_DIRS = (Path("/usr/lib/podman"), Path("/usr/libexec/podman"))
SBIN_DIRS = (Path("/usr/sbin"), Path("/sbin"))
PODMAN_NETWORK_PACKAGES = "netavark aardvark-dns iptables"


def check_podman_network(helper_dirs=PODMAN_HELPER_DIRS, sbin_dirs=SBIN_DIRS) -> None:
    """BuildError naming what to install when podman's network backend cannot run here:
    containers.conf picks netavark (with aardvark-dns, the services' names), and netavark
    sets each network up with iptables.  Without them every build step fails to get a
    network with a bare ``netavark: No such file or directory``."""
    missing = [name for name in ("netavark", "aardvark-dns")
               if not any((d / name).is_file() for d in helper_dirs)]
    if shutil.which("iptables") is None and not any((d / "iptables").is_file() for d in sbin_dirs):
        missing.append("iptables")
    if missing:
        raise BuildError(f"podman's network backend needs {', '.join(missing)}, not installed: on "
                         f"Debian apt-get install {PODMAN_NETWORK_PACKAGES} (see docs/deployment.md)")


def run(cmd: list[str], engine: str | None = None, env: dict[str, str] | None = None,
        **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, env=engine_env(engine) if engine else env, **kwargs)


def image_exists(engine: str, image: str) -> bool:
    return subprocess.run([engine, "image", "inspect", image], capture_output=True,
                          env=engine_env(engine), check=False).returncode == 0


def choose_base(engine: str, asked: str | None) -> str:
    """``asked``; else the registry's Python image when it is here or can be pulled; else the
    local Debian base, made first when missing."""
    if asked:
        return asked
    if image_exists(engine, REGISTRY_BASE):
        return REGISTRY_BASE
    try:
        pulled = subprocess.run([engine, "pull", "-q", REGISTRY_BASE], capture_output=True, text=True,
                                env=engine_env(engine), timeout=PULL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pulled = None
    if pulled is not None and pulled.returncode == 0:
        return REGISTRY_BASE
    print(f"{REGISTRY_BASE} cannot be pulled here: using the local Debian base {LOCAL_BASE}", flush=True)
    if not image_exists(engine, LOCAL_BASE):
        make_local_base(engine)
    return LOCAL_BASE


def make_local_base(engine: str) -> None:
    """A minimal Debian bookworm (debootstrap, from Debian's mirror) imported as LOCAL_BASE."""
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise BuildError("no registry answers and the local Debian base is missing: making it needs "
                         "root and debootstrap (apt-get install debootstrap), or give --base IMAGE")
    rootfs = ROOT / "build" / "images" / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs)], stdout=subprocess.DEVNULL)
    # What an image needs none of: the packages' archives and lists (an image's apt-get
    # update fetches lists again), documentation and manuals.
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
                     "usr/share/info"):
        for path in (rootfs / leftover).glob("*"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.name != "lock":
                path.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        run([engine, "import", "-", LOCAL_BASE], engine, stdin=tar.stdout, stdout=subprocess.DEVNULL)
    finally:
        tar.stdout.close()
        tar.wait()
        shutil.rmtree(rootfs, ignore_errors=True)


def make_wheels() -> tuple[str, str]:
    """WHEELS: the product's wheel and every dependency of it and of the local-triton extra,
    at the versions of constraints.txt, and each image's requirements; returns the digests of
    all it holds and of all but the product's wheel, which key the images' install layers
    (their wheels are mounted, not copied into a layer).  The
    product's wheel is rebuilt with its files' times fixed, so the same sources give the same
    bytes and a rebuild of unchanged sources takes the install layers from the cache."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "-q"]
    constraints = ROOT / "constraints.txt"
    fresh = WHEELS.parent / "product-wheel"
    # setuptools builds in build/: what an earlier build left there (a module since removed)
    # would go into the wheel.
    for leftover in (fresh, *ROOT.joinpath("build").glob("lib*"), *ROOT.joinpath("build").glob("bdist*")):
        shutil.rmtree(leftover, ignore_errors=True)
    # One time for every file in the wheel (zip entries keep it): the product's version's.
    fixed = dict(os.environ, SOURCE_DATE_EPOCH="1704067200")
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(fresh), str(ROOT)], env=fixed)
    (built,) = fresh.glob("multimodel_serving-*.whl")
    for old in WHEELS.glob("multimodel_serving-*.whl"):
        if old.name != built.name or old.read_bytes() != built.read_bytes():
            old.unlink()
    if not (WHEELS / built.name).exists():
        shutil.move(built, WHEELS / built.name)
    shutil.rmtree(fresh, ignore_errors=True)
    run([*pip, "download", "-d", str(WHEELS), "-c", str(constraints), "torch==2.13.0",
         f"{ROOT}[local-triton]"])
    if not (WHEELS / "constraints.txt").exists() or \
            (WHEELS / "constraints.txt").read_bytes() != constraints.read_bytes():
        shutil.copyfile(constraints, WHEELS / "constraints.txt")
    for image, extras in REQUIREMENTS.items():
        text = "\n".join(requirements(extras)) + "\n"
        path = WHEELS / f"requirements-{image}.txt"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return digest(lambda p: True), digest(lambda p: not p.name.startswith("multimodel_serving-"))


# The requirements each image installs before the product's own wheel (which then goes in
# alone): a change of the product's code rebuilds one small layer, not torch's.
REQUIREMENTS = {"control-plane": (), "triton": ("runtime", "local-triton")}


def requirements(extras: tuple[str, ...]) -> list[str]:
    """The product's dependencies and those of ``extras``, without the product itself."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += [r for r in project["optional-dependencies"][extra]
                   if not r.startswith(project["name"])]
    return wanted


def digest(chosen) -> str:
    """A digest of the files of WHEELS that ``chosen`` picks: their names and bytes."""
    hashed = hashlib.sha256()
    for path in sorted(WHEELS.iterdir()):
        if path.is_file() and chosen(path):
            hashed.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return hashed.hexdigest()[:16]


def version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def build(engine: str, dockerfile: str, image: str, base: str, wheels: tuple[str, str],
          target: str | None = None) -> None:
    tag = version()
    cmd = [engine, "build", "-f", str(ROOT / "docker" / dockerfile), "--build-arg", f"BASE={base}",
           "--build-arg", f"WHEELS={wheels[0]}", "--build-arg", f"DEPENDENCIES={wheels[1]}",
           "-t", f"{image}:{tag}", "-t", f"{image}:latest"]
    if target:
        cmd += ["--target", target]
    run([*cmd, str(WHEELS)], engine)


def size_mb(engine: str, image: str) -> float:
    out = subprocess.run([engine, "image", "inspect", "--format", "{{.Size}}", image], capture_output=True,
                         text=True, env=engine_env(engine), check=True).stdout
    return int(out.strip()) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docker/images.py", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("podman", "docker"), default=os.environ.get("MMS_ENGINE"))
    parser.add_argument("--base", help=f"base image of both (default: {REGISTRY_BASE} where it can "
                                       f"be pulled, else {LOCAL_BASE})")
    parser.add_argument("--gpu", action="store_true",
                        help=f"the Triton image from NGC's ({GPU_BASE}) instead of the wheel's")
    args = parser.parse_args(argv)
    try:
        engine = find_engine(args.engine)
        if Path(engine).name == "podman" and "CONTAINERS_CONF" not in os.environ:
            check_podman_network()
        base = choose_base(engine, args.base)
        wheels = make_wheels()
        build(engine, "Dockerfile", CONTROL_PLANE_IMAGE, base, wheels)
        if args.gpu:
            build(engine, "Dockerfile.triton", TRITON_IMAGE, GPU_BASE, wheels, target="gpu")
        else:
            build(engine, "Dockerfile.triton", TRITON_IMAGE, base, wheels, target="cpu")
    except BuildError as exc:
        print(f"make images: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"make images: {' '.join(map(str, exc.cmd))} failed with exit code {exc.returncode}",
              file=sys.stderr)
        return 1
    for image in (CONTROL_PLANE_IMAGE, TRITON_IMAGE):
        print(f"{image}:{version()}  {size_mb(engine, image + ':latest'):.0f} MB  (base {base})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
