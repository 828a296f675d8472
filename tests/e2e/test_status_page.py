"""The status page in a real browser (Debian's chromium, headless) against `mmctl up`:
it refuses callers without the token like every admin call, a browser signs in with the
token, and the page follows a load, a pin, an eviction, a shadow and a rolled-back canary
live, without a reload.  Markup in a filter or in a failure message stays text, and the
filter stays fast with thousands of models.  A screenshot goes to bench/results/."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from tests.browser import chromium
from tests.product import Product

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "bench" / "results" / "status_page.png"
WAIT_MS = 20_000
MARKUP = '<img src=x onerror="window.__pwned=1"><b>bold</b>'


@pytest.fixture(scope="module")
def product(tmp_path_factory):
    root = tmp_path_factory.mktemp("status-page")
    # The demo fleet (one model family): loads and evictions are slot copies, quick.
    p = Product(root / "state", None, "--fleet-size", "6", "--max-loaded", "4").start()
    p.endpoints = p.json("endpoints")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def browser():
    with chromium() as context:
        yield context


@pytest.fixture(scope="module")
def page(browser, product):
    """A tab signed in through the page's own form."""
    page = browser.new_page()
    errors: list[str] = []
    fetched: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda request: fetched.append(request.url))
    resp = page.goto(product.url + "/")
    assert resp.status == 401  # refused like any admin call; a browser gets the sign-in form
    page.fill("#token", "not-the-token")
    page.click("button[type=submit]")
    expect(page.locator("#error")).to_contain_text("not the admin token", timeout=WAIT_MS)
    page.fill("#token", product.token_file.read_text().strip())
    page.click("button[type=submit]")
    expect(page.locator("[data-kpi=models] [data-value=models]")).to_have_text(re.compile(r"\d+"),
                                                                            timeout=WAIT_MS)
    page.evaluate("window.__sameDocument = 1")  # gone if the page ever reloads
    yield page
    assert errors == [], errors
    # Everything the page loaded came from the control plane: it works without a network.
    elsewhere = [u for u in fetched if not u.startswith(product.url + "/")]
    assert elsewhere == [] and len(fetched) > 10, elsewhere


def expect(locator):
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


def infer(product, model: str, n: int = 1) -> None:
    client = grpcclient.InferenceServerClient(product.endpoints["router_grpc"])
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    for _ in range(n):
        client.infer(model, [x])


def mmctl_ok(product, *args: str) -> None:
    out = product.mmctl(*args)
    assert out.returncode == 0, (args, out.stdout, out.stderr)


def test_the_page_and_its_data_are_refused_without_the_token(product):
    url = product.url
    assert requests.get(url + "/", timeout=10).status_code == 401
    resp = requests.get(url + "/", headers={"Accept": "text/html"}, timeout=10)
    assert resp.status_code == 401 and 'id="signin"' in resp.text  # the form, not the page
    assert "WWW-Authenticate" in resp.headers
    assert requests.get(url + "/v1/overview", timeout=10).status_code == 401
    assert requests.get(url + "/", cookies={"mms_session": "9999999999.forged"},
                        timeout=10).status_code == 401
    # Another origin cannot read it, token or not.
    resp = requests.get(url + "/v1/overview", headers={**product.admin_headers(),
                                                     "Origin": "http://evil.example"}, timeout=10)
    assert resp.status_code == 403
    resp = requests.post(url + "/v1/session", json={"token": "wrong"}, timeout=10)
    assert resp.status_code == 401 and "mms_session" not in resp.cookies
    # A form post (no JSON) cannot sign in either.
    resp = requests.post(url + "/v1/session", data={"token": product.token_file.read_text().strip()},
                         timeout=10)
    assert resp.status_code == 415

    token = product.token_file.read_text().strip()
    resp = requests.post(url + "/v1/session", json={"token": token}, timeout=10)
    assert resp.status_code == 200
    cookie = resp.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    assert token not in cookie  # the cookie is derived from the token, not the token
    session = {"mms_session": resp.cookies["mms_session"]}
    page = requests.get(url + "/", cookies=session, timeout=10)
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert requests.get(url + "/v1/overview", cookies=session, timeout=10).json()["servers"]
    # The cookie opens the page and nothing else: no other read, and no change.
    assert requests.get(url + "/v1/status", cookies=session, timeout=10).status_code == 401
    assert requests.post(url + "/v1/models/cust006/load", json={}, cookies=session,
                         timeout=10).status_code == 401
    # The page's code and style carry no data and need no token.
    assert requests.get(url + "/static/app.js", timeout=10).status_code == 200
    assert requests.get(url + "/static/nosuch.js", timeout=10).status_code == 404
    assert requests.get(url + "/static/..%2f__init__.py", timeout=10).status_code == 404


def test_the_page_follows_a_load_a_pin_and_an_eviction_live(product, page):
    row = lambda model, col: page.locator(f'[data-model="{model}"] [data-col="{col}"]')
    mmctl_ok(product, "load", "cust001")
    expect(row("cust001", "state")).to_have_text("ready", timeout=WAIT_MS)
    expect(row("cust001", "tier")).to_have_text("hot", timeout=WAIT_MS)
    mmctl_ok(product, "pin", "cust001")
    expect(row("cust001", "pinned")).to_have_text("pin", timeout=WAIT_MS)
    expect(page.locator('[data-server="triton0"] [data-pinned="cust001"]')).to_be_visible(timeout=WAIT_MS)
    infer(product, "cust001", 5)  # served loaded: hit ratio 100%, latency
    for model in ("cust002", "cust003", "cust004"):
        mmctl_ok(product, "load", model)
    expect(page.locator('[data-slots="triton0"]')).to_have_text("4 / 4", timeout=WAIT_MS)
    mmctl_ok(product, "load", "cust005")  # room for 4: cust002, used least recently, goes
    expect(row("cust002", "state")).to_have_text("warm", timeout=WAIT_MS)
    expect(row("cust005", "state")).to_have_text("ready", timeout=WAIT_MS)
    expect(row("cust001", "hit_ratio")).to_contain_text("100%", timeout=WAIT_MS)
    expect(row("cust001", "p50_ms")).to_have_text(re.compile(r"\d ms$"), timeout=WAIT_MS)
    expect(page.locator("[data-value=evictions_per_min]")).to_have_text(re.compile(r"^[1-9]"),
                                                                       timeout=WAIT_MS)
    expect(page.locator("[data-value=misses_per_min]")).to_have_text(re.compile(r"^[1-9]"),
                                                                    timeout=WAIT_MS)

    # A shadow that disagrees with its primary, and a canary that fails its latency gate.
    mmctl_ok(product, "shadow", "start", "cust003", "--model", "cust004", "--percent", "100")
    infer(product, "cust003", 10)
    expect(page.locator('[data-divergence="cust003"]')).to_contain_text("100.0%", timeout=WAIT_MS)
    expect(page.locator('[data-dropped="cust003"]')).to_have_text("0")
    mmctl_ok(product, "canary", "start", "cust005", "--to", "cust006", "--stages", "50,100",
             "--stage-seconds", "60", "--check-interval", "0.3", "--min-requests", "3",
             "--max-failed-checks", "1", "--max-p99-ms", "0.01")
    deadline = time.monotonic() + 60
    while product.json("canary", "status", "cust005")["status"] == "running":
        assert time.monotonic() < deadline, "the canary was never judged"
        infer(product, "cust005", 4)
    expect(page.locator('[data-verdict="cust005"]')).to_have_text("rolled back", timeout=WAIT_MS)
    expect(page.locator('[data-why="cust005"]')).to_contain_text("p99", timeout=WAIT_MS)
    expect(page.locator('[data-percent="cust005"]')).to_have_text("0%")
    expect(page.locator("#problems")).to_contain_text("cust005 was rolled back")
    mmctl_ok(product, "experiment", "create", "rec-ab", "--control", "cust002", "--treatment",
             "cust006", "--treatment-percent", "30")
    expect(page.locator('[data-experiment="rec-ab"]')).to_contain_text("cust006 (30%)",
                                                                     timeout=WAIT_MS)
    assert page.evaluate("window.__sameDocument") == 1, "the page reloaded"

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(2500)  # one more poll: the plots take the last minute's points
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 20_000


def test_markup_in_a_filter_or_a_failure_stays_text(product, page, tmp_path):
    evil = tmp_path / "evil"
    (evil / "1").mkdir(parents=True)
    (evil / "config.pbtxt").write_text(
        'name: "evil"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    (evil / "1" / "model.py").write_text(f"raise RuntimeError({MARKUP!r})\n")
    mmctl_ok(product, "registry", "add", "evil", "--from-dir", str(evil))
    # The family holds every slot of --max-loaded 4: a separate model gets room once no
    # variant is left in it (the family is then unloaded for it).
    mmctl_ok(product, "unpin", "cust001")
    for row in product.json("status"):
        if row["state"] == "ready":
            mmctl_ok(product, "unload", row["model"])
    assert product.mmctl("load", "evil").returncode == 6  # its load fails with that message
    mmctl_ok(product, "pin", "cust001")  # the family is loaded again for it
    problem = page.locator('[data-problem="model"]').filter(has_text="evil.v1")
    expect(problem).to_contain_text(MARKUP, timeout=WAIT_MS)  # shown as the text it is
    assert page.locator("#problems img, #problems b:text('bold')").count() == 0

    page.fill("#filter", MARKUP)
    expect(page.locator("[data-query]")).to_have_text(f"“{MARKUP}”")
    assert page.locator("#models img, #models mark b").count() == 0
    page.fill("#filter", "")
    page.evaluate("q => { location.hash = '#q=' + encodeURIComponent(q); }", MARKUP)
    expect(page.locator("[data-query]")).to_have_text(f"“{MARKUP}”")
    assert page.evaluate("window.__pwned") is None
    page.fill("#filter", "cust00 state:ready pinned")
    expect(page.locator("#models [data-model]")).to_have_count(1)
    expect(page.locator("#models [data-model] mark")).to_have_text("cust00")
    page.fill("#filter", "")


def test_the_filter_stays_fast_with_thousands_of_models(product, page):
    """The real page on a real document, grown to 5,000 models on its way to the browser."""
    real = requests.get(product.url + "/v1/overview", headers=product.admin_headers(),
                        timeout=10).json()
    template = real["models"]["rows"][0]
    real["models"]["rows"] = [[f"tenant{i:05d}", *template[1:]] for i in range(5000)]
    body = json.dumps(real)
    page.route("**/v1/overview", lambda route: route.fulfill(
        status=200, content_type="application/json", body=body))
    try:
        expect(page.locator("#filter-count")).to_have_text("5,000 models", timeout=WAIT_MS)
        # Each query's best of three runs: a busy machine delays some runs, never all three,
        # while a page that drew every row would be slow on each of them.
        timings_ms = [min(page.evaluate("q => window.statusPage.filterTiming(q)", q)
                          for _ in range(3))
                      for q in ("tenant0", "tenant04", "tenant042", "4", "", "state:ready tenant1")]
        assert max(timings_ms) < 100, timings_ms  # filter, sort and draw the visible rows
        page.fill("#filter", "tenant0421")
        expect(page.locator("#filter-count")).to_have_text("10 of 5,000 models")
        page.fill("#filter", "")
        rendered = page.locator("#models [data-model]").count()
        assert 0 < rendered < 100, f"{rendered} rows in the document for 5,000 models"
    finally:
        page.unroute("**/v1/overview")
        page.fill("#filter", "")
