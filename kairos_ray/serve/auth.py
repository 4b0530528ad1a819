"""API keys for the ingress, the way vLLM's OpenAI server checks them.

Keys come from ``serving.api_keys``, from the environment variable named by
``serving.api_key_env`` (one key, or several separated by commas) and from
the file named by ``serving.api_key_file`` (one key per line). With no key,
the ingress answers anyone (the local configs); with one or more, every
request but ``/health`` must carry ``Authorization: Bearer <key>``, and the
ingress answers 401 with an OpenAI error object otherwise. A config that
requires a key (``serving.require_api_key``) and finds none fails at start.

Admin keys (``serving.admin_api_keys`` and the variable named by
``serving.admin_api_key_env``) are accepted keys that may also read what
concerns more than one tenant: ``GET /kairos/state``, the API docs and the
prompt tokens a node's prefix cache held for a request (a tenant told that
could probe, block by block, whether another's prompt is cached). In an
open app (no key at all) every caller is its admin: nothing tells tenants apart.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path


class ApiKeys:
    """The accepted keys and the admin keys among them; comparisons take constant time."""

    def __init__(self, keys: Iterable[str], admin_keys: Iterable[str] = ()) -> None:
        self._admin = [k.encode() for k in admin_keys if k]
        self._keys = [k.encode() for k in keys if k] + self._admin

    @classmethod
    def gather(
        cls,
        keys: Iterable[str],
        env: str | None,
        file: str | None,
        admin_keys: Iterable[str] = (),
        admin_env: str | None = None,
    ) -> ApiKeys:
        """Keys from the config, the environment variable ``env`` and the file ``file``; admin keys from the
        config and the variable ``admin_env``."""
        found = [*keys, *_from_env(env)]
        if file:
            try:
                found += Path(file).expanduser().read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"serving.api_key_file {file!r} cannot be read: {exc}") from None
        return cls(_cleaned(found), _cleaned([*admin_keys, *_from_env(admin_env)]))

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries an accepted key (always, when none is set)."""
        return not self._keys or _holds(authorization, self._keys)

    def admin(self, authorization: str | None) -> bool:
        """Whether it carries an admin key (always in an open app)."""
        return not self._keys or _holds(authorization, self._admin)


def _from_env(name: str | None) -> list[str]:
    return os.environ[name].split(",") if name and os.environ.get(name) else []


def _cleaned(keys: Iterable[str]) -> list[str]:
    return [k.strip() for k in keys if k.strip()]


def _holds(authorization: str | None, keys: list[bytes]) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    given = token.strip().encode()
    return any(hmac.compare_digest(given, key) for key in keys)
