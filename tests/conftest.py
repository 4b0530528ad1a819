import os

from hypothesis import HealthCheck, settings

# Shared 2-core machines: never fail a property on wall-clock time.
settings.register_profile("kairos", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kairos")

# Every test that starts Ray starts its own, never joins a cluster already running on the machine (`make run`).
os.environ["RAY_ADDRESS"] = "local"
