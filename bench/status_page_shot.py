"""The status page after a few minutes of a skewed demo workload, photographed in Debian's
chromium: the picture docs/status_page.png is made with.

    python -m bench.status_page_shot [--seconds 360] [--dark] [--out PATH]

`mmctl up` with 24 demo customers as one family and room for 8, two of them pinned; three
clients send Zipf-skewed requests (s = 1.1) for ``--seconds``, while an A/B experiment, a
shadow, a canary that passes its checks and one that fails them (cust017-faulty fails one
request in two) run.  Then a browser signs in with the admin token and saves the page.
Needs Debian's chromium (tests/system_packages.py installs it, as root).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.browser import chromium
from tests.product import Product
from tests.system_packages import PackagesMissing, ensure

ROOT = Path(__file__).resolve().parent.parent
CUSTOMERS = [f"cust{i:03d}" for i in range(1, 25)]


def traffic(product: Product, seconds: float, clients: int = 3) -> int:
    end = time.monotonic() + seconds
    weights = [1 / (i + 1) ** 1.1 for i in range(len(CUSTOMERS))]
    sent = [0] * clients

    def client(n: int) -> None:
        rnd = random.Random(n)
        c = grpcclient.InferenceServerClient(product.endpoints["router_grpc"])
        x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
        x.set_data_from_numpy(np.ones((1, 64), np.float32))
        while time.monotonic() < end:
            model = rnd.choices(CUSTOMERS, weights)[0]
            if rnd.random() < 0.3:  # the routes with rollouts get their share
                model = rnd.choice(["cust003", "cust004", "cust006", "cust007"])
            try:
                c.infer(model, [x])
            except InferenceServerException:
                pass  # the failing canary's errors are the point
            sent[n] += 1
            time.sleep(rnd.uniform(0.05, 0.25))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(sent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=360.0)
    parser.add_argument("--dark", action="store_true", help="the page in dark mode")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "status_page_demo.png")
    args = parser.parse_args()
    try:
        ensure("chromium")
    except PackagesMissing as exc:  # a picture needs the browser; say so instead of a traceback
        print(f"status_page_shot: skipped, no picture taken: {exc}")
        return
    with tempfile.TemporaryDirectory(prefix="mms-shot-") as root:
        product = Product(Path(root) / "state", None, "--fleet-size", "24", "--max-loaded", "8").start()
        try:
            product.endpoints = product.json("endpoints")
            for command in (
                    ["pin", "cust001"], ["pin", "cust002"],
                    ["experiment", "create", "rec-ab", "--control", "cust003", "--treatment",
                     "cust017-v2", "--treatment-percent", "20"],
                    ["shadow", "start", "cust004", "--model", "cust017-v3", "--percent", "50"],
                    ["canary", "start", "cust006", "--to", "cust017-v2", "--stages", "10,25,50,100",
                     "--stage-seconds", str(args.seconds / 5), "--check-interval", "5",
                     "--min-requests", "10", "--max-p99-ms", "400"],
                    ["canary", "start", "cust007", "--to", "cust017-faulty", "--stages", "10,50,100",
                     "--stage-seconds", "100", "--check-interval", "5", "--min-requests", "10",
                     "--max-failed-checks", "3"]):
                out = product.mmctl(*command)
                assert out.returncode == 0, (command, out.stderr)
            sent = traffic(product, args.seconds)
            with chromium() as browser:
                browser_page = browser.new_page()
                browser_page.emulate_media(color_scheme="dark" if args.dark else "light")
                browser_page.goto(product.url + "/")
                browser_page.fill("#token", product.token_file.read_text().strip())
                browser_page.click("button[type=submit]")
                browser_page.wait_for_selector("[data-kpi=models]")
                browser_page.wait_for_timeout(6000)  # two reads of the router's series
                args.out.parent.mkdir(parents=True, exist_ok=True)
                browser_page.screenshot(path=str(args.out), full_page=True)
        finally:
            product.stop()
    print(f"{sent} requests in {args.seconds:.0f} s; the page: {args.out}")


if __name__ == "__main__":
    main()
