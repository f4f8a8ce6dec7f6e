"""Shared pytest set-up: hypothesis profiles and the ``seed`` fixture.

``ci`` (default): fresh random examples every run, no per-example deadline (CI
machines are slow and shared). ``long``: many more examples, for sweeps before
a release: ``pytest tests --hypothesis-profile=long``.

``seed``: a fresh random seed for a test that spawns ranks and draws all its inputs from one
seed (one example per run; hypothesis would draw its minimal example, 0, first, so such a
test would see the same inputs every run). It is printed with a failure;
``AXEDIST_TEST_SEED=1234 pytest ...`` repeats it.
"""

import os
import random

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", parent=settings.get_profile("ci"), max_examples=3000)
settings.load_profile("ci")


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("AXEDIST_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"seed: AXEDIST_TEST_SEED={value}")  # shown with a failure's captured output
    return value
