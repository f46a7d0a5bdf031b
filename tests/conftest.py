import pytest
import torch

from diffusiond.models.tiny import build_tiny

# 2 cores on CI; more threads than cores slows torch down by an order of magnitude.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory) -> str:
    return str(build_tiny("sd3", tmp_path_factory.mktemp("tiny") / "sd3"))


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> str:
    return str(build_tiny("flux", tmp_path_factory.mktemp("tiny") / "flux"))
