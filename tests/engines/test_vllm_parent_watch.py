"""A node's engine core ends with its replica (``engines.vllm_parent_watch``), on real processes: a "replica" that
starts a child as vLLM starts an engine core (the plugin called in it), then is killed outright."""

import importlib.metadata
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from kairos_ray.engines.vllm_parent_watch import PARENT_ENV, end_with_parent

CORE = (  # as vLLM's engine core: its general plugins called as it starts (its output: the replica's, the test's)
    "import time; from kairos_ray.engines.vllm_parent_watch import end_with_parent; end_with_parent(); "
    "print('started', flush=True); time.sleep(600)"
)
REPLICA = textwrap.dedent(f"""
    import os, subprocess, sys, time
    os.environ[{PARENT_ENV!r}] = str(os.getpid())
    core = subprocess.Popen([sys.executable, "-c", {CORE!r}])
    print(core.pid, flush=True)
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its new parent to reap it."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def line_within(stream, seconds: float) -> str:
    """The stream's next line, or TimeoutError (the reader thread ends when the test kills the writers)."""
    reader = ThreadPoolExecutor(1)
    try:
        return reader.submit(stream.readline).result(timeout=seconds)
    finally:
        reader.shutdown(wait=False)


def test_an_engine_core_ends_soon_after_its_replica_is_killed():
    replica = subprocess.Popen([sys.executable, "-c", REPLICA], stdout=subprocess.PIPE, text=True)
    core = 0
    try:
        core = int(line_within(replica.stdout, 120))
        assert line_within(replica.stdout, 120) == "started\n"  # the core's plugin has run
        replica.send_signal(signal.SIGKILL)
        replica.wait(timeout=30)
        deadline = time.monotonic() + 60
        while alive(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(core), "the engine core outlived its replica by 60 s"
    finally:
        replica.kill()
        if core and alive(core):
            os.kill(core, signal.SIGKILL)


@pytest.mark.parametrize("value", ["", "not-a-pid", "self"])
def test_any_other_process_is_left_alone(monkeypatch, value):
    """No watch where the variable is unset, malformed, or names a live process that is not the parent (the
    replica itself; the engine core's workers, whose parent is the core)."""
    monkeypatch.setenv(PARENT_ENV, str(os.getpid()) if value == "self" else value)
    end_with_parent()
    assert "kairos-parent-watch" not in [thread.name for thread in threading.enumerate()]


def test_vllm_finds_the_watch_among_its_general_plugins():
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "kairos_ray.engines.vllm_parent_watch:end_with_parent" in [plugin.value for plugin in plugins]
