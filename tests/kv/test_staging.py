"""Staged KV files live in private directories: checked, never through a link, cleaned after a crash."""

import os
import subprocess

import pytest

from kairos_ray.kv.staging import OWNER, Staging, node_staging_dir, open_private, private_dir


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


def test_a_crashed_nodes_directory_is_removed_by_the_next_engine_and_a_live_ones_kept(tmp_path):
    root = str(tmp_path / "root")
    live = node_staging_dir("app", "decode-live", root)
    gone = node_staging_dir("app", "decode-gone", root)
    finished = subprocess.Popen(["true"])
    finished.wait()
    with open(os.path.join(gone, OWNER), "w") as f:
        f.write(str(finished.pid))  # its owner has exited: as after a crash
    with open(os.path.join(gone, "left.rank0.pt"), "wb") as f:
        f.write(b"stale KV")
    fresh = node_staging_dir("app", "prefill-new", root)
    assert os.path.isdir(live) and os.path.isdir(fresh) and not os.path.exists(gone)
    staging = Staging(fresh)
    params = staging.stage("r1", {0: b"abc"}, 3)
    assert Staging.collect(params) == {0: b"abc"}
    staging.close()
    assert not os.path.exists(fresh)
