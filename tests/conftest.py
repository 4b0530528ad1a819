import os

from hypothesis import HealthCheck, settings

# Shared 2-core machines: never fail a property on wall-clock time.
settings.register_profile("kairos", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kairos")

# Every test that starts Ray starts its own, never joins a cluster already running on the machine (`make run`).
os.environ["RAY_ADDRESS"] = "local"
# Those clusters listen on loopback only, as `make run`'s: no Ray token (a ~/.ray/auth_token on the machine
# would turn Ray's token auth on, and the dashboard's page would ask a browser for the token).
os.environ["RAY_AUTH_MODE"] = "disabled"
