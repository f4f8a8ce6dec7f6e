"""Running plans: moving local tensors with torch.distributed and the collectives, and the deferred GEMM."""
