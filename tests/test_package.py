"""The package's public surface: every exported name resolves, and importing is light."""

import subprocess
import sys


def test_every_exported_name_resolves_without_triton():
    code = (
        "import sys, axedist as ax\n"
        "assert 'torch' not in sys.modules, 'import axedist must not import torch'\n"
        "missing = [n for n in ax.__all__ if getattr(ax, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert 'triton' not in sys.modules, 'resolving the API must not import triton'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_name_is_an_attribute_error():
    import axedist

    try:
        axedist.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
