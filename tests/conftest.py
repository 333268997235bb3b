import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Make every test deterministic."""
    random.seed(0)
    torch.manual_seed(0)
    yield
