"""Torch ops on axedist DTensors: sharding rules per op family, and the dispatcher.

Importing this package registers every family's rules (``registry.RULES``). The dispatcher
(``dispatcher.OpDispatcher``) is created by the tensor class, which passes itself in: nothing
here imports ``axedist.dtensor``.
"""

from importlib import import_module

from .call_plan import DispatchError
from .registry import RULES, ArgSpec, OpCall, Sharding, register, rule_for
from .strategies import register_sharding

# One module per op family (rules registered per family, not one switch).
FAMILIES = ("pointwise", "matmul", "view", "tensor_ops", "reduction", "norm", "batch_norm",
            "embedding", "loss", "attention", "random", "complex", "along_dim", "batched", "vector_products")

for _family in FAMILIES:
    import_module(f".{_family}", __name__)

__all__ = ["RULES", "ArgSpec", "OpCall", "Sharding", "register", "rule_for", "register_sharding", "FAMILIES",
           "DispatchError"]
