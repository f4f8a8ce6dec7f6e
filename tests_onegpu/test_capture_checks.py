"""Device-value checks inside a CUDA graph, on one GPU.

``runtime.checks.check_range`` cannot read the values on the host while a graph is captured
(the capture refuses a device-to-host copy), so it asserts on the device there: the graph holds
the check and every replay runs it. Found as ``launch/infer_tp.py --cuda --cuda-graphs`` at TP=2
stopping in capture at the vocabulary-sharded embedding (2026-11-30, 2x H200). The embedding
itself needs 2 ranks to take that path (one rank holds every row: torch's own lookup runs):
``tests_multigpu/test_ops_nn_nccl.py::test_vocab_sharded_embedding_captured_in_a_cuda_graph``.

    pytest tests_onegpu/test_capture_checks.py
"""
import torch

from axedist.runtime import checks
from axedist.testing import capture


def test_range_check_is_captured_and_replayed(seed):
    values = torch.randint(0, 10, (64,), device="cuda")
    seen = []

    def step():
        seen.append(checks.capturing(values))
        checks.check_range(values, 10, "index {value} is out of range")
        return values * 2

    graph, doubled = capture(step)
    assert seen == [False, False, True]  # the warm-up read on the host; the capture did not
    for _ in range(3):
        values.copy_(torch.randint(0, 10, values.shape, device="cuda"))
        graph.replay()
        assert torch.equal(doubled, values * 2)
