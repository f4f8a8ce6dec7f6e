"""Probe: an offloaded FSDP model's tags and optimizer state (tests_multigpu/test_fsdp_offload_nccl.py
failed at 764c6b0 on 1x H200: AdamW state reporting cuda with its data on the CPU), and how far CPU
offload moves training from the plain model's, axedist's and torch's fully_shard alike (bf16 compute
with fp32 masters: AdamW on the CPU rounds differently). One rank; prints findings, no asserts.

    python3 benchmarks/device/probe_offload.py
"""
import torch
from onegpu_probe import one_rank_group  # noqa: E402  (beside this script; the repository on PYTHONPATH)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from axedist.dtensor import DTensor
from axedist.mesh import DeviceMesh
from axedist.nn.llama import Llama
from tests_multigpu.test_fsdp_offload_nccl import CFG, _relative, _sharded, _torch_sharded, _train

dispatcher = DTensor.dispatcher


def tag_device(t):
    tag = getattr(t, "_tag", None)
    found = [k[3] for k, v in dispatcher._tags.items() if v.number == tag.number] if tag is not None else []
    return found[0] if found else None


def mismatches(what, pairs):
    bad = [(n, t.device, t.to_local().device) for n, t in pairs if t.device != t.to_local().device]
    tags = [(n, tag_device(t)) for n, t in pairs if tag_device(t) not in (None, t.to_local().device)]
    print(f"   {what}: {len(bad)} of {len(pairs)} wrapper/piece device mismatches {bad[:3]}; "
          f"{len(tags)} tags of another device {tags[:3]}", flush=True)


def torch_model(policy, offload):
    torch.manual_seed(0)
    model = Llama(CFG) if offload is not None else Llama(CFG).cuda()
    return _torch_sharded(model, 1, policy, offload or OffloadPolicy())


def drift(what, ours, want):
    cols = []
    for a, b in zip(ours[0], want[0]):
        cols.append(max(_relative(a[2][n], b[2][n]) for n in a[2]))
    after = max(_relative(ours[1][n], want[1][n]) for n in ours[1])
    print(f"   {what:34s} worst gradient per step {['%.1e' % c for c in cols]}, parameters after {after:.1e}",
          flush=True)


def main():
    one_rank_group(29561)
    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = DeviceMesh("cuda", (1,), ("dp",))
    for mixed in (False, True):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
            else MixedPrecisionPolicy()
        print(f"== mixed={mixed}", flush=True)
        torch.manual_seed(0)
        ax_plain = _train(_sharded(Llama(CFG).cuda(), mesh, policy, None), 1, 0, 1)
        torch.manual_seed(0)
        model = _sharded(Llama(CFG), mesh, policy, CPUOffloadPolicy(pin_memory=True))
        mismatches("offloaded parameters", list(model.named_parameters()))
        ax_off = _train(model, 1, 0, 1)
        opt = ax_off[2]
        mismatches("exp_avg after 3 steps", [(n, opt.state[p]["exp_avg"]) for n, p in model.named_parameters()])
        t_plain = _train(torch_model(policy, None), 1, 0, 1)
        t_off = _train(torch_model(policy, CPUOffloadPolicy(pin_memory=True)), 1, 0, 1)
        drift("axedist offloaded vs plain", ax_off, ax_plain)
        drift("torch offloaded vs plain", t_off, t_plain)
        drift("axedist vs torch, plain", ax_plain, t_plain)
        drift("axedist vs torch, offloaded", ax_off, t_off)
        print("   losses", [round(s[0], 6) for s in ax_off[0]], [round(s[0], 6) for s in t_off[0]], flush=True)
        del model, opt


if __name__ == "__main__":
    main()
