"""Kairos-Ray: load-aware prefill deflection for disaggregated LLM serving on Ray."""

__version__ = "0.1.0"
