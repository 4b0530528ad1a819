"""Staged KV files live in private directories: checked, never through a link, owned by a lock, cleaned after a crash.

Owners that must outlive or die apart from the test run in processes of their
own (real ``flock`` locks, real exits), as engines in separate containers do.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kairos_ray.engines.vllm_events import events_endpoint
from kairos_ray.kv.staging import LOCK, SETUP_S, Staging, node_staging, open_private, private_dir

REPO = Path(__file__).resolve().parents[2]

OWNER = """
import os, sys
from kairos_ray.kv.staging import node_staging
staging = node_staging(*sys.argv[1:5])
print(staging.directory, flush=True)
sys.stdin.read()  # until the test lets go
os._exit(0)  # no close: as a crash, the directory stays behind
"""


class Owner:
    """An engine's staging owner in a process of its own; ``end`` makes it exit as a crash would."""

    def __init__(self, app: str, node_id: str, ray_node_id: str, root: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", OWNER, app, node_id, ray_node_id, root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.directory = self.process.stdout.readline().strip()
        assert self.directory, "the owner did not start"

    def end(self) -> None:
        self.process.stdin.close()
        assert self.process.wait(timeout=60) == 0


@pytest.fixture
def owners():
    started: list[Owner] = []

    def start(*args: str) -> Owner:
        started.append(Owner(*args))
        return started[-1]

    yield start
    for owner in started:
        owner.process.kill()
        owner.process.wait(timeout=60)


def dead_pid() -> int:
    finished = subprocess.Popen(["true"])
    finished.wait()
    return finished.pid


def age(directory: str) -> None:
    """As if the directory had not changed for longer than a setup takes."""
    then = time.time() - 2 * SETUP_S
    os.utime(directory, (then, then))


def test_directories_are_created_private_and_foreign_ones_are_refused(tmp_path):
    made = private_dir(str(tmp_path / "mine"))
    assert os.stat(made).st_mode & 0o777 == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 755; it must be 700"):
        private_dir(str(loose))
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(PermissionError, match="not a directory"):
        private_dir(str(tmp_path / "link"))


def test_files_are_created_exclusively_and_never_through_a_link(tmp_path):
    directory = private_dir(str(tmp_path / "node"))
    target = tmp_path / "elsewhere"
    target.write_text("secret")
    os.symlink(target, os.path.join(directory, "k.rank0.pt"))
    with pytest.raises(OSError):  # an existing name, a link at that
        open_private(os.path.join(directory, "k.rank0.pt"), "wb")
    with pytest.raises(OSError):
        open_private(os.path.join(directory, "k.rank0.pt"), "rb")
    assert target.read_text() == "secret"
    with open_private(os.path.join(directory, "new"), "wb") as f:
        f.write(b"kv")
    assert os.stat(os.path.join(directory, "new")).st_mode & 0o777 == 0o600


def test_a_locked_directory_is_kept_whatever_its_pid_says_and_a_free_one_is_removed(tmp_path, owners):
    """Two containers: neither can see the other's pid, and the lock alone says which one is gone."""
    root = str(tmp_path / "root")
    live = owners("app", "decode-live", "ray-node", root)
    with open(os.path.join(live.directory, LOCK), "w") as f:
        f.write(f"{dead_pid()}\n")  # its pid means nothing here: another pid namespace
    crashed = owners("app", "decode-crashed", "ray-node", root)
    with open(os.path.join(crashed.directory, "left.rank0.pt"), "wb") as f:
        f.write(b"stale KV")
    crashed.end()
    age(live.directory)
    age(crashed.directory)

    fresh = node_staging("app", "prefill-new", "ray-node", root)
    assert os.path.isdir(live.directory) and not os.path.exists(crashed.directory)
    params = fresh.stage("r1", {0: b"abc"}, 3)
    assert Staging.collect(params) == {0: b"abc"}

    live.end()  # now its lock is free too
    node_staging("app", "prefill-later", "ray-node", root).close()
    assert not os.path.exists(live.directory)
    fresh.close()
    assert not os.path.exists(fresh.directory)


def test_a_directory_without_a_lock_is_left_while_it_may_be_being_set_up(tmp_path):
    parent = Path(private_dir(str(tmp_path / "root")))
    for level in ("ray-node", "app"):
        parent = Path(private_dir(str(parent / level)))
    setting_up = private_dir(str(parent / "decode-new"))  # made, not locked yet
    node_staging("app", "prefill-0", "ray-node", str(tmp_path / "root")).close()
    assert os.path.isdir(setting_up)
    age(setting_up)  # an owner that crashed before it locked
    node_staging("app", "prefill-1", "ray-node", str(tmp_path / "root")).close()
    assert not os.path.exists(setting_up)


def test_a_live_owners_directory_cannot_be_taken_over(tmp_path, owners):
    root = str(tmp_path / "root")
    live = owners("app", "decode-0", "ray-node", root)
    with pytest.raises(PermissionError, match="owned by a live engine"):
        node_staging("app", "decode-0", "ray-node", root)
    assert os.path.isdir(live.directory)


def test_each_ray_node_keeps_to_its_own_directories(tmp_path, owners):
    root = str(tmp_path / "root")
    here = node_staging("app", "decode-0", "ray-a", root)
    there = owners("app", "decode-0", "ray-b", root)  # the same names on another Ray node: another directory
    assert here.directory != there.directory
    there.end()
    age(there.directory)
    node_staging("app", "prefill-0", "ray-a", root).close()
    assert os.path.isdir(there.directory)  # abandoned, but ray-b's to clean
    node_staging("app", "prefill-0", "ray-b", root).close()
    assert not os.path.exists(there.directory)
    here.close()


def test_an_engines_event_socket_in_its_staging_directory_fits_a_socket_address():
    ray_node_id = "f" * 56  # as long as Ray's node ids are
    staging = node_staging("kairos", "decode-abcdefgh", ray_node_id)  # under the default root, as engines use
    try:
        path = events_endpoint(staging.directory).removeprefix("ipc://")
        assert len(path.encode()) < 108  # sockaddr_un.sun_path, NUL included
    finally:
        staging.close()
