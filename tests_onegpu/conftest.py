"""One-GPU tests: `pytest tests_onegpu` on a machine with one CUDA GPU (H100 / H200).

The kernels' ranks run as virtual ranks (axedist.testing.VirtualRanks): W ranks in this one
process, each on its own stream and its own carved workspace. Without CUDA every test here is
skipped (CI is CPU-only and runs tests/). Set before CUDA starts: enough hardware queues that
no rank's launch waits behind another rank's spinning kernel, multicast off (project policy),
and a spin-wait timeout short enough that a hang fails a test instead of the run.
"""
import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.pop("AXEDIST_ENABLE_MULTICAST", None)
os.environ.setdefault("AXEDIST_TIMEOUT_S", "20")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

HAVE_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (one-GPU tests; CI runs tests/)")
    for item in items:
        item.add_marker(skip)


@pytest.fixture
def seed():
    """A fresh seed per test (printed in failure messages so a failure can be replayed)."""
    value = random.SystemRandom().randrange(1 << 31)
    torch.manual_seed(value)
    if HAVE_CUDA:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references stay fp32
    return value


@pytest.fixture(scope="session")
def group():
    """A one-rank NCCL process group for the tests that make a one-GPU mesh, one for the whole
    session: axedist keeps per-group state (meshes, workspaces), which a group destroyed and made
    again between test files would leave pointing at an aborted communicator."""
    import torch.distributed as dist

    if not dist.is_initialized():  # an in-process store: no port, so xdist workers never collide
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()
