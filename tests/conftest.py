import os
import tempfile

import pytest
import torch

# torch.compile caches compiled graphs on disk, keyed without teeny's code: a graph cached by
# another checkout of teeny would be replayed. Each test session compiles into its own folder.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="teeny-inductor-"))

import teeny

on_gpu = teeny.DEVICE.type == "cuda"


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def pytest_report_header(config):
    return f"teeny device: {teeny.core.device.describe()}"


_assert_close = torch.testing.assert_close


def _assert_close_any_device(actual, expected, *args, **kwargs):
    """The suite runs unchanged on the CPU and on a GPU: references are often computed on the
    CPU while teeny's executor returns tensors on its own device. Compare values, not places."""
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) and actual.device != expected.device:
        actual, expected = actual.cpu(), expected.cpu()
    return _assert_close(actual, expected, *args, **kwargs)


_equal, _allclose = torch.equal, torch.allclose


def _on_one_device(fn):
    def wrapper(a, b, *args, **kwargs):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device != b.device:
            a, b = a.cpu(), b.cpu()
        return fn(a, b, *args, **kwargs)

    return wrapper


if on_gpu:
    torch.testing.assert_close = _assert_close_any_device
    torch.equal, torch.allclose = _on_one_device(_equal), _on_one_device(_allclose)
