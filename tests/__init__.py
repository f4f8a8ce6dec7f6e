"""The CPU test suite, a package so the multi-GPU and one-GPU suites can run its test bodies
(``from tests.test_dtensor import roundtrip``) with NCCL instead of gloo."""
