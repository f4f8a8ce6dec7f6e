"""The ``AXEDIST_*`` environment variables: each one's meaning, parsed and checked in one place.

Every reader in the package goes through ``read(name)``; ``check_environment()`` (run when the
package is imported) reads every variable that is set, so a bad value fails at once with the
variable's name and what it accepts::

    >>> os.environ["AXEDIST_FASTPATH"] = "false"
    >>> read("AXEDIST_FASTPATH")                 # flags take 0/1, true/false, yes/no, on/off
    False
    >>> os.environ["AXEDIST_COLLECTIVE_TIMEOUT_S"] = "-5"
    >>> read("AXEDIST_COLLECTIVE_TIMEOUT_S")
    EnvironmentVariableError: AXEDIST_COLLECTIVE_TIMEOUT_S='-5': expected seconds > 0 ...

A set ``AXEDIST_*`` name that is not in the table (a typo) gets a warning. Pure Python: no torch.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable

from .caches import memo

__all__ = ["EnvironmentVariableError", "Variable", "VARIABLES", "read", "check_environment", "MULTICAST_OFF",
           "keep_multicast_off"]

# NVLink multicast stays off on the project's shared GPU hosts (policy): the switches of NCCL,
# torch's symmetric memory and NVSHMEM, set in every process (tests' ranks, launchers, benchmarks).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off() -> None:
    """Set each ``MULTICAST_OFF`` switch this process has not set; call it before importing torch
    (the libraries read them when they start), e.g. first thing in a launcher."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvironmentVariableError(ValueError):
    """An ``AXEDIST_*`` variable set to a value it does not accept."""


@dataclass(frozen=True)
class Variable:
    """One variable: its parser (text -> value, ValueError when refused), what it accepts, its
    default when unset, and what it does."""

    name: str
    parse: Callable[[str], object]
    accepts: str
    default: object
    meaning: str

    def __repr__(self) -> str:
        return f"Variable({self.name}: {self.accepts}, default {self.default!r})"


def _flag(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError
    return value


def _positive_int(text: str) -> int:
    value = int(text.strip())  # int() refuses "2.5"; it reads other scripts' digits, so check ASCII
    if value <= 0 or not text.strip().isascii():
        raise ValueError
    return value


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError
        return text
    return parse


def _text(text: str) -> str:
    return text


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("AXEDIST_FASTPATH", _flag, "a flag (0/1, true/false, yes/no, on/off)", True,
             "the torch-function fast path for repeated op calls (ops/fastpath.py)"),
    Variable("AXEDIST_COLLECTIVE_TIMEOUT_S", _seconds, "seconds > 0", None,
             "how long a host collective or an agreement check waits for its peers before it raises "
             "PeerError (init_mesh's timeout_s wins; unset: the job's own timeout, 600 s under init_mesh)"),
    Variable("AXEDIST_TIMEOUT_S", _seconds, "seconds > 0", 30.0,
             "how long a GPU kernel spin-waits for a peer's flag before CollectiveTimeoutError"),
    Variable("AXEDIST_ENABLE_MULTICAST", _flag, "a flag (0/1, true/false, yes/no, on/off)", False,
             "allow the multimem (NVLink SHARP) backend where the device supports multicast"),
    Variable("AXEDIST_PLAN_BACKEND", _choice("auto", "torch", "p2p", "multimem"), "auto, torch, p2p or multimem",
             "auto", "the collectives backend that planned CUDA steps ask for"),
    Variable("AXEDIST_FUSED_BACKEND", _choice("auto", "torch", "p2p", "multimem", "symm"),
             "auto, torch, p2p, multimem or symm",
             "auto", "what the layout-driven fused GEMM kernels ask for: the measured tables (auto), the fused "
             "kernels pinned (p2p), torch's symmetric-memory ops pinned (symm), never fused (torch)"),
    Variable("AXEDIST_DECODE_GEMM", _choice("auto", "cublas"), "auto or cublas", "auto",
             "what CUDA products of at most 64 rows run locally: the skinny GEMM where its table measured it "
             "faster than cuBLAS (auto), torch.mm always (cublas)"),
    Variable("AXEDIST_CE_GRAPHS", _flag, "a flag (0/1, true/false, yes/no, on/off)", False,
             "a copy-engine (/ce) GEMM + reduce-scatter or all-gather + GEMM issues its copies (and stream "
             "waits) as one CUDA graph per call, not two or three CUDA calls per comm chunk (off until "
             "measured on 2+ GPUs: the driver may run a graph's copies on SMs, which a full persistent grid "
             "holds)"),
    Variable("AXEDIST_P2P_ROWS", _positive_int, "an int > 0", None,
             "forces the p2p collectives' tile height (benchmark sweeps)"),
    Variable("AXEDIST_P2P_ROUNDS", _positive_int, "an int > 0", None,
             "forces the p2p reduce-scatter / all-gather pipeline ranges (benchmark sweeps)"),
    Variable("AXEDIST_HOST_SIZE", _positive_int, "an int > 0 that divides the world size", None,
             "simulates hosts of this many consecutive ranks"),
    Variable("AXEDIST_COMMIT", _text, "any text", None, "the commit benchmarks record"),
    Variable("AXEDIST_SKIP_TRITON_TESTS", _flag, "a flag (0/1, true/false, yes/no, on/off)", False,
             "tests: skip (visibly) the Triton tests when Triton is missing"),
    Variable("AXEDIST_TEST_SEED", _text, "an int", None,
             "tests: the seed of the tests that draw from one (tests/conftest.py), to repeat a failure"),
)}

# (name, text) -> value: a reader on a hot path parses once
_PARSED: dict[tuple[str, str], object] = memo("env parsed values")


def read(name: str):
    """The value of ``name`` (its default when unset or empty); EnvironmentVariableError when
    the text is not one the variable accepts."""
    variable = VARIABLES[name]
    text = os.environ.get(name, "")
    if text == "":
        return variable.default
    key = (name, text)
    if key not in _PARSED:
        try:
            _PARSED[key] = variable.parse(text)
        except (ValueError, OverflowError):
            raise EnvironmentVariableError(f"{name}={text!r}: expected {variable.accepts} ({variable.meaning}); "
                                           f"unset it for the default ({variable.default!r})") from None
    return _PARSED[key]


def check_environment() -> None:
    """Read every ``AXEDIST_*`` variable that is set (raising on the first bad one); warn about
    names the table does not know."""
    for name in sorted(os.environ):
        if not name.startswith("AXEDIST_"):
            continue
        if name in VARIABLES:
            read(name)
        else:
            warnings.warn(f"{name} is set but axedist has no such variable (known: {', '.join(VARIABLES)})",
                          stacklevel=2)
