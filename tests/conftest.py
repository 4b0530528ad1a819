from hypothesis import HealthCheck, settings

# Shared 2-core machines: never fail a property on wall-clock time.
settings.register_profile("kairos", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kairos")
