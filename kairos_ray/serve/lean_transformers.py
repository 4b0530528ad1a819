"""Keeps scikit-learn out of the processes that import vLLM to serve its OpenAI protocol.

vLLM's config imports transformers' auto classes, and with them transformers' assisted-generation
module, which imports ``sklearn.metrics`` whenever scikit-learn is installed; it is, for
the step-latency fitter (``serve.refit``). The ingress never runs transformers' generation, so
imported before vLLM this module has transformers' availability check answer no in its process:
the import is skipped, and scikit-learn itself stays importable for whatever else the process runs.
Imported after transformers' generation modules it changes nothing (scikit-learn is loaded then).
"""

from __future__ import annotations

import sys

import transformers.utils
from transformers.utils import import_utils


def _unavailable() -> bool:
    """transformers' ``is_sklearn_available`` in this process: assisted generation runs without it."""
    return False


if "transformers.generation.candidate_generator" not in sys.modules:
    for module in (transformers.utils, import_utils):  # the name candidate_generator imports, and its definition
        vars(module)["is_sklearn_available"] = _unavailable
