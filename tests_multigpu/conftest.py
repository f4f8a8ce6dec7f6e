"""Multi-GPU tests: run with `pytest tests_multigpu` on a machine with >= 2 NVLink GPUs.

The world size is torch.cuda.device_count() (use CUDA_VISIBLE_DEVICES to run at W=2 and W=4).
Multicast stays off (project policy): these variables are forced for every rank.
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.pop("AXEDIST_ENABLE_MULTICAST", None)

# the CPU suite's hypothesis profile (no per-example deadline: a first NCCL call on fresh ranks
# takes hundreds of ms) also for the property tests the multi-GPU files run
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")
