import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# Shared 2-core machines: never fail a property on wall-clock time.
settings.register_profile("kairos", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kairos")

# Every test that starts Ray starts its own, never joins a cluster already running on the machine (`make run`).
os.environ["RAY_ADDRESS"] = "local"
# Those clusters listen on loopback only, as `make run`'s: no Ray token (a ~/.ray/auth_token on the machine
# would turn Ray's token auth on, and the dashboard's page would ask a browser for the token).
os.environ["RAY_AUTH_MODE"] = "disabled"

LAYERS = ("ray", "vllm")


def pytest_collection_modifyitems(items):
    """Every test not marked ``ray`` or ``vllm`` (by its module's ``pytestmark``) is a ``unit`` test; the tests
    marked ``own_ray`` run first, so that the Ray the app modules share (``tests/shared_ray.py``) starts once.

    ``make test`` runs the unit layer, the vLLM app layer (``ray and vllm``) and the other live tests in three
    processes side by side (``scripts/test_suite.sh``)."""
    for item in items:
        if not any(item.get_closest_marker(layer) for layer in LAYERS):
            item.add_marker(pytest.mark.unit)
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is None)  # stable: in file order otherwise


@pytest.fixture(autouse=True)
def _unit_tests_start_no_ray(request, monkeypatch):
    """A unit test that would start Ray fails at once, naming the layer its module belongs to."""
    if request.node.get_closest_marker("unit") is None:
        return
    import ray
    import ray._private.worker

    def refuse(*args, **kwargs):
        raise RuntimeError("a unit test started Ray: mark its module pytestmark = pytest.mark.ray")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray._private.worker, "init", refuse)


def pytest_sessionfinish(session, exitstatus):
    """The Ray the app modules shared (``tests/shared_ray.py``) goes with the session."""
    from tests import shared_ray

    shared_ray.stop()
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Once every plugin has reported, leave with the session's status without finalizing the interpreter.

    The in-process vLLM engines leave native threads (torch, tokenizers, gRPC from Ray's driver) that
    Python's finalization can tear down under them: a run whose every test passed could still end in a
    segmentation fault, and its exit status was the crash's, not the tests'. An xdist worker exits as
    xdist says; ``pytest.main`` called from a test (none here) would not return.
    """
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or hasattr(config, "workerinput"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
