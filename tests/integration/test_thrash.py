"""Thrash: many clients over more models than fit, through the router, on the real stack.
Slow is acceptable under thrash; an error for a request that could be served is not, and
neither is an answer that is not the asked model's own (a swap gone wrong serves another
model's weights under the right name and shape)."""

from __future__ import annotations

import random
import shutil
import threading

import pytest
import tritonclient.grpc as grpcclient

from tests.integration.answers import Answers, features
from tests.product import Product

pytestmark = pytest.mark.integration

CLIENTS, REQUESTS_EACH = 16, 5
MODELS = [f"cust00{i}" for i in range(1, 9)]


def thrash_checking_answers(url: str, answers: Answers,
                            requests_each: int = REQUESTS_EACH) -> tuple[int, list[str]]:
    """CLIENTS threads, each sending ``requests_each`` requests one after the other to models
    drawn at random; (requests answered, failures), where a failure is an error or an answer
    that is not the model's own."""
    failures: list[str] = []
    answered = [0]
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        c = grpcclient.InferenceServerClient(url)
        try:
            for i in range(requests_each):
                model = rng.choice(MODELS)
                x = features(1, seed=seed * 1000 + i)
                inp = grpcclient.InferInput("FEATURES", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                try:
                    scores = c.infer(model, [inp], client_timeout=240).as_numpy("SCORES")
                except Exception as exc:  # noqa: BLE001  (every failure is the test's finding)
                    with lock:
                        failures.append(f"{model}: {str(exc)[:200]}")
                    continue
                with lock:
                    answered[0] += 1
                    if not answers.matches(model, x, scores):
                        found = answers.which(MODELS, x, scores) or "no model here"
                        failures.append(f"{model}: answered {scores.ravel().tolist()}, "
                                        f"the answer of {found}")
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answered[0], failures


def assert_thrash_loses_nothing(p: Product, answers: Answers,
                                requests_each: int = REQUESTS_EACH) -> None:
    """Thrash the started product ``p`` over cust001..cust008; stop it; every request was
    answered with its model's own scores."""
    answers.assert_distinct(MODELS, features(1, seed=0))  # the value check has teeth
    try:
        answered, failures = thrash_checking_answers(p.json("endpoints")["router_grpc"], answers,
                                                     requests_each)
        sent = CLIENTS * requests_each
        # The product's warnings and errors say why (a server declared down, a load that failed).
        said = [line for line in p.log_text().splitlines() if " WARNING " in line or " ERROR " in line]
        assert failures == [], (f"{len(failures)} of {sent} failed: {failures[:5]}\n"
                                + "\n".join(said[-40:]))
        assert answered == sent
    finally:
        p.stop()
        p.assert_no_triton_left()


def test_thrash_over_separate_models_loses_no_request(fleet_template, tmp_path):
    repo = tmp_path / "repository"
    shutil.copytree(fleet_template, repo)
    # 3 requests a client: 16 clients over 8 models with room for 3 still miss on most
    # requests, and each miss of a model of its own is a Triton load (about a second).
    assert_thrash_loses_nothing(Product(tmp_path / "state", repo, "--max-loaded", "3",
                                        "--router-workers", "1", "--policy", "lru").start(),
                                Answers(repo), requests_each=3)


def test_thrash_over_a_family_loses_no_request(tmp_path):
    assert_thrash_loses_nothing(Product(tmp_path / "state", None, "--fleet-size", "8",
                                        "--max-loaded", "3", "--router-workers", "1",
                                        "--policy", "lru").start(),
                                Answers(family=True))
