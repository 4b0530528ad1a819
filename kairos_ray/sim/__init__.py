"""Discrete-event simulator of a disaggregated cluster, deciding with the core's own policies (``kairos sim``)."""
