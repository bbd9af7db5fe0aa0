import os

import pytest
import torch

import teeny


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def pytest_report_header(config):
    return f"teeny device: {teeny.device.describe()}"


on_gpu = teeny.DEVICE.type == "cuda"
