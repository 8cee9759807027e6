import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "nsa", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
# New random examples on every run (the default's are fixed, so that CI is reproducible): HYPOTHESIS_PROFILE=fuzz
settings.register_profile("fuzz", settings.get_profile("nsa"), derandomize=False, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "nsa"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def compile_settings():
    """Every compile in the suite runs the passes (no FX-graph-cache hits from earlier runs), and the many models
    compiled from the one ``Indexer.decode`` code object stay under Dynamo's recompile limit."""
    import torch._dynamo
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False), torch._dynamo.config.patch(
        recompile_limit=256, accumulated_recompile_limit=1024
    ):
        yield


@pytest.fixture(autouse=True)
def seeded_rng():
    """The global RNG seeded before each test: a test's unseeded draws do not depend on which tests ran before it in
    its worker process (the suite runs in two)."""
    torch.manual_seed(0)
