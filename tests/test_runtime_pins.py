"""The backend pins (axedist/runtime/pins.py): a process-wide value each, its AXEDIST_* variable
the default, which ``pinned_backends`` changes for every thread while its block runs."""

import threading

import pytest
import torch

import axedist
from axedist.runtime import fused_backend, pinned_backends, plan_backend
from axedist.runtime.pins import FUSED, PLAN, Pin


@pytest.fixture(autouse=True)
def process_pins():
    """Each test leaves the process's pins as it found them."""
    plan, fused = plan_backend(), fused_backend()
    yield plan, fused
    plan_backend(plan)
    fused_backend(fused)


def test_the_block_pins_and_an_inner_block_restores_the_outer_ones_pin(process_pins):
    plan, fused = process_pins
    with pinned_backends(fused="torch"):
        assert (plan_backend(), fused_backend()) == (plan, "torch")
        assert repr(FUSED) == "Pin(fused_backend='torch')"
        with pinned_backends(plan="p2p", fused="symm"):
            assert (plan_backend(), fused_backend()) == ("p2p", "symm")
        assert (plan_backend(), fused_backend()) == (plan, "torch")
    assert (plan_backend(), fused_backend()) == (plan, fused)
    assert repr(FUSED) == f"Pin(fused_backend={fused!r})"


def test_the_block_restores_after_an_exception(process_pins):
    with pytest.raises(RuntimeError, match="step failed"):
        with pinned_backends(plan="torch", fused="p2p"):
            raise RuntimeError("step failed")
    assert (plan_backend(), fused_backend()) == process_pins


def test_a_bad_backend_names_the_choices_and_sets_nothing(process_pins):
    with pytest.raises(ValueError, match=r"pinned_backends\(fused=...\) must be one of \('auto', 'p2p', 'multimem', "
                                         r"'torch', 'symm'\), got 'nccl'"):
        with pinned_backends(plan="torch", fused="nccl"):
            pass
    assert (plan_backend(), fused_backend()) == process_pins  # plan= was fine, and still not set
    with pytest.raises(ValueError, match=r"plan_backend must be one of \('auto', 'p2p', 'multimem', 'torch'\), "
                                         r"got 'symm'"):
        plan_backend("symm")  # the fused kernels' choice, not the planned collectives'
    with pytest.raises(ValueError, match="fused_backend must be one of"):
        fused_backend("nccl")
    assert (plan_backend(), fused_backend()) == process_pins


def test_the_setter_pins_for_every_thread_and_inside_a_block_until_it_ends(process_pins):
    assert fused_backend("p2p") == "p2p"
    seen = []
    worker = threading.Thread(target=lambda: seen.append(fused_backend()))
    worker.start()
    worker.join()
    assert seen == ["p2p"] and fused_backend() == "p2p"
    with pinned_backends(fused="torch"):
        assert fused_backend("symm") == "symm"
    assert fused_backend() == "p2p"  # the block puts back what was there when it was entered


def test_every_thread_sees_the_block_while_it_runs_and_the_restored_pin_after(process_pins):
    plan, fused = process_pins
    inside, read_inside, after = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def already_running():
        assert inside.wait(timeout=30)
        seen["running, inside"] = (plan_backend(), fused_backend())
        read_inside.set()
        assert after.wait(timeout=30)
        seen["running, after"] = (plan_backend(), fused_backend())

    def read(key):
        thread = threading.Thread(target=lambda: seen.setdefault(key, (plan_backend(), fused_backend())))
        thread.start()
        thread.join()

    running = threading.Thread(target=already_running)
    running.start()
    with pinned_backends(plan="torch", fused="torch"):
        inside.set()
        assert read_inside.wait(timeout=30)  # the block stays open until the running thread has read
        read("started inside")
    after.set()
    running.join()
    read("started after")
    assert seen == {"running, inside": ("torch", "torch"), "started inside": ("torch", "torch"),
                    "running, after": (plan, fused), "started after": (plan, fused)}


def test_a_backward_sees_the_pin_of_the_block_it_runs_in():
    plan_backend("auto"), fused_backend("auto")
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append((plan_backend(), fused_backend()))
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    with pinned_backends(plan="torch", fused="symm"):
        Probe.apply(x).sum().backward()
        after = Probe.apply(x).sum()
    after.backward()  # recorded inside, run after: the pin restored
    assert seen == [("torch", "symm"), ("auto", "auto")]


def test_the_default_is_the_variable_and_reset_keeps_the_pins(monkeypatch, process_pins):
    monkeypatch.setenv("AXEDIST_FUSED_BACKEND", "torch")
    assert Pin("fused_backend", FUSED.choices, FUSED.variable).value == "torch"
    assert (PLAN.variable, FUSED.variable) == ("AXEDIST_PLAN_BACKEND", "AXEDIST_FUSED_BACKEND")
    plan_backend("torch")
    axedist.reset()  # forgets memos; a pin is a setting, not a memo
    assert plan_backend() == "torch"
