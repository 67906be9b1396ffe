from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from topomesh import load_topology
from topomesh.errors import OutputError, TopologyError
from topomesh.topology import api
from topomesh.topology.build import build_topology, default_placement

from .helpers import dgx_host

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_load_topology_reads_env_var(monkeypatch):
    monkeypatch.setenv(api.ENV_VAR, str(GOLDEN / "two_hosts_nvlink_pairs.v01.json"))
    assert load_topology().world_size == 4


def test_load_topology_explains_missing_env(monkeypatch):
    monkeypatch.delenv(api.ENV_VAR, raising=False)
    with pytest.raises(TopologyError, match="WORLD_TOPOLOGY_FILE is not set"):
        load_topology()


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "unrecognised content"), (b"\xff\xfe\x00garbage", "not UTF-8"), (b"hello world", "unrecognised content")],
)
def test_unreadable_files(tmp_path, content, message):
    p = tmp_path / "t.json"
    p.write_bytes(content)
    with pytest.raises(TopologyError, match=message):
        api.read_source(p)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(TopologyError, match="no such file"):
        api.read_source(tmp_path / "nope.json")
    with pytest.raises(TopologyError, match="is a directory"):
        api.read_source(tmp_path)


def test_save_is_atomic_and_chooses_form(tmp_path):
    hosts = [dgx_host("a"), dgx_host("b")]
    t = build_topology(hosts, default_placement(hosts, [8, 8]))
    p = api.save_topology(t, tmp_path / "topo.json")
    assert '"version": "0.1"' in p.read_text()
    p2 = api.save_topology(t, tmp_path / "topo.json", dense_max_ranks=8)
    assert '"topomesh-compact"' in p2.read_text()
    assert stat.S_IMODE(os.stat(p2).st_mode) == 0o644
    assert sorted(x.name for x in tmp_path.iterdir()) == ["topo.json"]  # no temp files left


def test_write_atomic_leaves_old_file_on_failure(tmp_path, monkeypatch):
    p = tmp_path / "f.json"
    p.write_text("old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        api.write_atomic(p, "new")
    assert p.read_text() == "old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.json"]


def test_write_atomic_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match=rf"^{fifo} is a named pipe \(FIFO\), not a regular file: refusing to "
                                          r"replace it; name a regular file or a new path$"):
        api.write_atomic(fifo, "x")  # neither blocks on the pipe nor renames over it
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(OutputError, match=rf"^{tmp_path} is a directory, not a regular file"):
        api.write_atomic(tmp_path, "x")
    link = tmp_path / "to-fifo"
    link.symlink_to(fifo)
    with pytest.raises(OutputError, match=rf"^{link} \(a link to {fifo}\) is a named pipe"):
        api.write_atomic(link, "x")
    assert link.is_symlink() and sorted(x.name for x in tmp_path.iterdir()) == ["fifo", "to-fifo"]


def test_write_atomic_follows_a_link_to_a_regular_file(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert api.write_atomic(link, "new") == link
    assert link.is_symlink() and os.readlink(link) == str(real)  # the link stays a link
    assert real.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made.json")  # as a shell's `>` does: the named file is created
    api.write_atomic(dangling, "made")
    assert (tmp_path / "made.json").read_text() == "made" and dangling.is_symlink()


def test_byte_order_mark_is_tolerated(tmp_path):
    p = tmp_path / "bom.json"
    p.write_bytes(b"\xef\xbb\xbf" + (GOLDEN / "two_hosts_nvlink_pairs.v01.json").read_bytes())
    assert api.read_source(p).world_size == 4


def test_unwritable_path_is_a_topology_error(tmp_path):
    t = api.read_source(GOLDEN / "two_hosts_nvlink_pairs.v01.json")
    with pytest.raises(TopologyError, match="cannot write the topology file"):
        api.save_topology(t, tmp_path / "no" / "such" / "dir.json")
