"""API keys for the ingress, the way vLLM's OpenAI server checks them.

Keys come from ``serving.api_keys``, from the environment variable named by
``serving.api_key_env`` (one key, or several separated by commas) and from
the file named by ``serving.api_key_file`` (one key per line). With no key,
the ingress answers anyone (the local configs); with one or more, every
request but ``/health`` must carry ``Authorization: Bearer <key>``, and the
ingress answers 401 with an OpenAI error object otherwise. A config that
requires a key (``serving.require_api_key``) and finds none fails at start.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path


class ApiKeys:
    """The accepted keys; ``allows`` compares in constant time."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    @classmethod
    def gather(cls, keys: Iterable[str], env: str | None, file: str | None) -> ApiKeys:
        """Keys from the config, the environment variable ``env`` and the file ``file``."""
        found = [k.strip() for k in keys]
        if env and os.environ.get(env):
            found += [k.strip() for k in os.environ[env].split(",")]
        if file:
            try:
                found += [line.strip() for line in Path(file).expanduser().read_text().splitlines()]
            except OSError as exc:
                raise ValueError(f"serving.api_key_file {file!r} cannot be read: {exc}") from None
        return cls(k for k in found if k)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries an accepted key (always, when none is set)."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        return any(hmac.compare_digest(given, key) for key in self._keys)
