"""The one-process model as the FSDP tests' oracle: after each backward every gradient of the
sharded model equals the one-process model's (and is sharded like its parameter), then both
optimizers step; after the steps the parameters and the optimizer state agree the same way.
float64 and ``TOL64``, so AdamW's rounding cannot pass for a bug or fail a correct run."""

import torch

from axedist.dtensor import DTensor

TOL64 = dict(rtol=1e-9, atol=1e-11)


def gradients_then_step(step, ref, par, opt_ref, opt_par, *, clip=None, label=lambda name: name, each=None):
    """``clip``: both models' ``clip_grad_norm_`` to it first, the norms equal. ``each(name, p)``:
    a test's own check of every sharded parameter (its gradient set) before the comparison."""
    if clip is not None:
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        norm = torch.nn.utils.clip_grad_norm_(par.parameters(), clip)
        torch.testing.assert_close(norm.full_tensor(), norm_ref, **TOL64)
    for (name, p_ref), p in zip(ref.named_parameters(), par.parameters()):
        if p_ref.grad is None:
            assert p.grad is None, f"{label(name)}: a frozen parameter got a gradient"
            continue
        if each is not None:
            each(name, p)
        assert p.grad._spec == p._spec, f"{label(name)}: gradient {p.grad._spec} is not sharded like {p._spec}"
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL64,
                                   msg=lambda m: f"step {step}: grad of {label(name)}: {m}")
    for opt in (opt_ref, opt_par):
        opt.step()
        opt.zero_grad()


def same_after_steps(ref, par, opt_ref, opt_par, steps: int, *, label=lambda name: name, each=None):
    """The parameters, and every optimizer state tensor (sharded like its parameter), equal."""
    for (name, p_ref), p in zip(ref.named_parameters(), par.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref.detach(), **TOL64,
                                   msg=lambda m: f"after {steps} steps: {label(name)}: {m}")
        if each is not None:
            each(name, p)
        for key, value in opt_par.state.get(p, {}).items():
            if isinstance(value, DTensor) and value.dim():
                assert value._spec == p._spec, f"{label(name)}: optimizer state {key} is not sharded like the parameter"
                torch.testing.assert_close(value.full_tensor(), opt_ref.state[p_ref][key], **TOL64,
                                           msg=lambda m: f"after {steps} steps: {label(name)}'s {key}: {m}")
