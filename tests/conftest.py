"""Shared pytest set-up: hypothesis profiles.

``ci`` (default): fresh random examples every run, no per-example deadline (CI
machines are slow and shared). ``long``: many more examples, for sweeps before
a release: ``pytest tests --hypothesis-profile=long``.
"""

from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", parent=settings.get_profile("ci"), max_examples=3000)
settings.load_profile("ci")
