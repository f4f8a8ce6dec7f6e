"""Probe: why an offloaded FSDP model's AdamW state reports cuda with its data on the CPU, and how far
its bf16 training drifts from the plain model's (tests_multigpu/test_fsdp_offload_nccl.py failed at
764c6b0 on 1x H200). One rank; prints findings, no asserts.

    python3 benchmarks/device/probe_offload.py
"""
import torch
from onegpu_probe import one_rank_group  # noqa: E402  (beside this script; the repository on PYTHONPATH)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy  # noqa: E402
from axedist.dtensor import DTensor  # noqa: E402
from axedist.mesh import DeviceMesh  # noqa: E402
from axedist.nn.llama import Llama  # noqa: E402
from tests_multigpu.test_fsdp_offload_nccl import CFG, _relative, _sharded, _train  # noqa: E402

dispatcher = DTensor.dispatcher


def tag_key(t):
    tag = getattr(t, "_tag", None)
    if tag is None:
        return None
    return [k[1:] for k, v in dispatcher._tags.items() if v.number == tag.number] or f"#{tag.number} gone"


def mismatches(what, pairs):
    bad = [(n, t.device, t.to_local().device, tag_key(t)) for n, t in pairs if t.device != t.to_local().device]
    print(f"{what}: {len(bad)} of {len(pairs)} wrapper/piece device mismatches", flush=True)
    for b in bad[:6]:
        print("   ", b, flush=True)


def main():
    one_rank_group(29561)
    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = DeviceMesh("cuda", (1,), ("dp",))
    for mixed in (False, True):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
            else MixedPrecisionPolicy()
        for fast in (True, False):
            dispatcher.fastpath.enable(fast)
            dispatcher.clear_caches()
            print(f"== mixed={mixed} fastpath={fast}", flush=True)
            torch.manual_seed(0)
            plain = _sharded(Llama(CFG).cuda(), mesh, policy, None)
            want = _train(plain, 1, 0, 1)
            torch.manual_seed(0)
            model = _sharded(Llama(CFG), mesh, policy, CPUOffloadPolicy(pin_memory=True))
            mismatches("offloaded parameters", list(model.named_parameters()))
            likes = [(n, torch.zeros_like(p, memory_format=torch.preserve_format)) for n, p in model.named_parameters()]
            mismatches("zeros_like of each", likes)
            print("   tags of the first params:", [(n, tag_key(p)) for n, p in list(model.named_parameters())[:4]])
            ours = _train(model, 1, 0, 1)
            opt = ours[2]
            mismatches("exp_avg after 3 steps", [(n, opt.state[p]["exp_avg"]) for n, p in model.named_parameters()])
            mismatches("gradients", [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None])
            for step, (a, b) in enumerate(zip(ours[0], want[0])):
                worst = max((_relative(a[2][n], b[2][n]), n) for n in a[2])
                print(f"   step {step}: loss {a[0]:.6f} vs {b[0]:.6f}, norm {a[1]:.5f} vs {b[1]:.5f}, worst gradient "
                      f"{worst[1]} {worst[0]:.2e}", flush=True)
            worst = max((_relative(ours[1][n], want[1][n]), n) for n in ours[1])
            print(f"   parameters after: worst {worst[1]} {worst[0]:.2e}", flush=True)
            del plain, model, opt, ours, want


if __name__ == "__main__":
    main()
