"""Step-latency profiling and fitting (the only scikit-learn user)."""
