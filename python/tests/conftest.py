"""Shared pytest fixtures of the Python tests.

`seed`: the seed a test draws its random inputs from: fresh every run, or ATTNRT_TEST_SEED to replay
one. A failing test that uses it reports the seed.
"""
import os
import random

import pytest

SEED = int(os.environ.get("ATTNRT_TEST_SEED", random.SystemRandom().randrange(1 << 30)))


@pytest.fixture
def seed() -> int:
    return SEED


def pytest_report_header(config):
    return f"attnrt: random inputs from seed {SEED} (ATTNRT_TEST_SEED={SEED} replays them)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "seed" in getattr(item, "fixturenames", ()):
        report.sections.append(("attnrt seed", f"inputs drawn from seed {SEED}; replay with "
                                               f"ATTNRT_TEST_SEED={SEED}"))
