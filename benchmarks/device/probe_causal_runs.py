"""One rank's lower-right causal run of context-parallel attention (n queries ending at position
stop over keys [0, stop)), forward + backward, by five routes on one GPU: the causal bias's
lower-right dispatch (flash), axedist's merged runs (square causal + unmasked, cuDNN), a boolean mask through SDPA, the whole run without a mask (an upper
bound of the work), and a square causal call of the same n (a lower bound). bf16, 32 / 8 heads,
head dim 128. Prints ms per route and the kernels' names.

    python3 benchmarks/device/probe_causal_runs.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from axedist.nn.attention import causal_runs


def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0),
                  key=lambda r: -r[1])
    return [k[:60] for k, _ in rows[:2]]


for n, stop in ((4096, 8192), (8192, 32768), (16384, 32768), (2048, 32768)):
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 8, stop, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    kx, vx = (t.detach().repeat_interleave(4, 1).requires_grad_() for t in (k, v))
    mask = torch.arange(stop, device="cuda")[None, :] <= (stop - n + torch.arange(n, device="cuda"))[:, None]
    routes = {
        "bias_lower_right": lambda: CausalBias._dispatch(q, kx, vx, attn_mask=causal_lower_right(n, stop)).backward(g),
        "merged_runs": lambda: causal_runs(q, kx, vx, [(stop - n, stop)]).backward(g),
        "bool_mask_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).backward(g),
        "bool_mask_expanded": lambda: F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask).backward(g),
        "no_mask_gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True).backward(g),
        "square_causal_n": lambda: F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], is_causal=True,
                                                                  enable_gqa=True).backward(g),
    }
    print(f"== n {n} queries, keys [0, {stop}): needed work {(n * stop - n * n / 2) / (n * stop):.2f} of the full rectangle")
    for name, fn in routes.items():
        try:
            print(f"   {name:20s} {timed(fn):8.3f} ms  {kernels(fn)}")
        except Exception as error:
            print(f"   {name:20s} failed: {type(error).__name__}: {str(error)[:120]}")
