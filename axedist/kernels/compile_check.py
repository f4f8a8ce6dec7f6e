"""Compile a Triton kernel for a GPU that is not present (e.g. sm_90a on a CPU-only CI machine).

Used by the CPU tests to prove that the kernels, including the multimem backend that never runs
on our GPU machines, produce valid PTX and assemble with ptxas for Hopper.

    >>> ptx = compile_for_target(reduce_scatter_kernel, signature, constexprs).asm["ptx"]
    >>> "multimem.ld_reduce" in ptx
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for_target(kernel, signature, constexprs, divisible_by_16=(), capability=90,
                       num_warps=4, num_stages=3):
    """triton.compile for CUDA `capability` (90 means sm_90a); returns the CompiledKernel.

    signature: {argument name: Triton type string ("*bf16", "i32", "i64", "constexpr")};
    divisible_by_16: argument names Triton may assume 16-byte (pointers) / 16 (ints) divisible,
    as it would specialize at a real launch.
    """
    names = kernel.arg_names
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    full_signature = dict(signature)
    for name in constexprs:
        full_signature[name] = "constexpr"
    source = ASTSource(fn=kernel, signature=full_signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target,
                          options={"num_warps": num_warps, "num_stages": num_stages})
