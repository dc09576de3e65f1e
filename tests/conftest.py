import os

# Keep test runs off the user's cache and make every process of a test see the same cache.
os.environ.setdefault("AGORA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "agora-test"))
os.environ.setdefault("USE_LEGACY_BFLOAT16", "0")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: OpenMP threads only add contention on a shared machine (QR is 500x slower with 2 threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
