"""The AXEDIST_* environment variables: parsed in one place, a bad value is a clear error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from axedist import env
from axedist.env import EnvironmentVariableError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, value", [("0", False), ("false", False), ("No", False), ("off", False),
                                         ("1", True), ("TRUE", True), ("yes", True), (" on ", True), ("", True)])
def test_flags(monkeypatch, text, value):
    monkeypatch.setenv("AXEDIST_FASTPATH", text)
    assert env.read("AXEDIST_FASTPATH") is value


@pytest.mark.parametrize("name, text", [
    ("AXEDIST_FASTPATH", "fasle"), ("AXEDIST_FASTPATH", "2"),
    ("AXEDIST_TIMEOUT_S", "-5"), ("AXEDIST_TIMEOUT_S", "0"), ("AXEDIST_TIMEOUT_S", "nan"), ("AXEDIST_TIMEOUT_S", "inf"),
    ("AXEDIST_TIMEOUT_S", "30s"), ("AXEDIST_COLLECTIVE_TIMEOUT_S", "-1"), ("AXEDIST_HOST_SIZE", "2.5"),
    ("AXEDIST_HOST_SIZE", "\u0662"), ("AXEDIST_P2P_ROUNDS", "0"), ("AXEDIST_PLAN_BACKEND", "nccl"),
    ("AXEDIST_ENABLE_MULTICAST", "maybe"), ("AXEDIST_CE_GRAPHS", "2"),
])
def test_bad_values_are_refused_with_the_name(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    with pytest.raises(EnvironmentVariableError, match=name):
        env.read(name)
    with pytest.raises(EnvironmentVariableError, match=f"{name}={text!r}: expected"):
        env.check_environment()


def test_values_and_defaults(monkeypatch):
    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert env.read("AXEDIST_TIMEOUT_S") == 30.0 and env.read("AXEDIST_COLLECTIVE_TIMEOUT_S") is None
    assert env.read("AXEDIST_FASTPATH") is True and env.read("AXEDIST_ENABLE_MULTICAST") is False
    assert env.read("AXEDIST_CE_GRAPHS") is False
    monkeypatch.setenv("AXEDIST_CE_GRAPHS", "on")
    assert env.read("AXEDIST_CE_GRAPHS") is True
    monkeypatch.setenv("AXEDIST_COLLECTIVE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("AXEDIST_HOST_SIZE", "2")
    assert env.read("AXEDIST_COLLECTIVE_TIMEOUT_S") == 2.5 and env.read("AXEDIST_HOST_SIZE") == 2


def test_unknown_names_warn(monkeypatch):
    monkeypatch.setenv("AXEDIST_FAST_PATH", "0")
    with pytest.warns(UserWarning, match="AXEDIST_FAST_PATH is set but axedist has no such variable"):
        env.check_environment()


def _run(code: str, **variables) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AXEDIST_")}
    environment.update(variables, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120)


def test_import_checks_the_environment_and_the_fast_path_follows_it():
    bad = _run("import axedist", AXEDIST_TIMEOUT_S="-5")
    assert bad.returncode != 0 and "AXEDIST_TIMEOUT_S='-5': expected seconds > 0" in bad.stderr, bad.stderr
    check = "from axedist.dtensor import DTensor; print(DTensor.dispatcher.fastpath.enabled())"
    assert _run(check, AXEDIST_FASTPATH="false").stdout.split() == ["False"]  # was on: only "0" meant off
