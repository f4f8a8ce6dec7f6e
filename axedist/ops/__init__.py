"""Torch ops on axedist DTensors: sharding rules per op family, and the dispatcher.

Importing this package registers every family's rules (``registry.RULES``).
"""

from importlib import import_module

from .registry import RULES, ArgSpec, OpCall, Sharding, register, rule_for

# One module per op family (STYLE: rules registered per family, not one switch).
FAMILIES = ("pointwise", "matmul", "view", "tensor_ops", "reduction", "norm",
            "embedding", "loss", "attention", "random")

for _family in FAMILIES:
    import_module(f".{_family}", __name__)

__all__ = ["RULES", "ArgSpec", "OpCall", "Sharding", "register", "rule_for", "FAMILIES"]
