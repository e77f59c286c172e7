"""The shared files read through ``pread`` (proxy/server/record/sharedstate.py, observe/inflight.py, metricfiles.py),
one process, real files: damage reads as damage, a write lays the file out again, nothing raises what a caller
does not expect, and every file is 0600. The same damage under ``serve --workers 2`` with traffic flowing is in
tests/system/test_damage.py.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict

from proxy.server.observe.inflight import MAP_BYTES, TRAFFIC_FILE, TrafficProfile
from proxy.server.record.metricfiles import CHECK_EVERY, PwriteDict, batch
from proxy.server.record.sharedstate import StateFile


def test_a_cut_state_file_reads_as_none_and_the_next_write_lays_it_out(tmp_path: Path) -> None:
    f = StateFile(tmp_path / "state.json")
    f.write({"a": 1, "events": []}, durable=True)
    assert f.read()[1] == {"a": 1, "events": []}
    for path in (tmp_path / "state.json", tmp_path / "state.json.shm"):
        assert path.stat().st_mode & 0o777 == 0o600
    os.truncate(tmp_path / "state.json.shm", 0)
    assert f.gen() == b"" and f.read() == (b"", None)
    f.write({"a": 2, "events": []})
    assert f.read()[1] == {"a": 2, "events": []}
    # a slot length past the slot, a copy that is no JSON: errors the reader expects
    with open(tmp_path / "state.json.shm", "r+b") as raw:
        raw.seek(64)  # slot 0: the write after the cut laid the file out anew
        raw.write(struct.pack("<I", 2**32 - 1))
    with pytest.raises(ValueError):
        f.read()
    (tmp_path / "state.json").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError):
        f.read_copy()
    f.close()


def test_a_garbled_traffic_file_starts_again_from_zero(tmp_path: Path) -> None:
    path = tmp_path / TRAFFIC_FILE
    p = TrafficProfile(shared=path, slot=0)
    p.enter()
    assert path.stat().st_mode & 0o777 == 0o600
    for damage in (
        lambda: os.truncate(path, 0),
        lambda: os.truncate(path, 100),
        lambda: path.write_bytes(struct.pack("<4s4xqd", b"EMT1", 1 << 62, float("inf")) + b"\0" * MAP_BYTES),
        lambda: path.write_bytes(struct.pack("<4s4xqdd", b"EMT1", 1, 0.0, float("nan")) + b"\0" * MAP_BYTES),
    ):
        damage()
        h = p.health()["traffic"]
        assert h["in_flight"] == 0 and h["observed_s"] >= 0, h
        p.enter()
        p.leave()
    assert p._shared is not None and p._shared.damage == 4
    p.close()


def test_metric_files_written_through_pwrite_survive_a_cut(tmp_path: Path) -> None:
    name = str(tmp_path / "counter_1.db")
    d = PwriteDict(name)
    with batch():
        d.write_value("a", 1.0, 0.0)
        d.write_value("b", 2.0, 0.0)
    assert list(MmapedDict.read_all_values_from_file(name)) == [("a", 1.0, 0.0, 16), ("b", 2.0, 0.0, 40)]  # type: ignore[no-untyped-call]
    os.truncate(name, 0)
    for i in range(CHECK_EVERY):
        d.write_value("a", float(i), 0.0)
    values = {k: v for k, v, _, _ in MmapedDict.read_all_values_from_file(name)}  # type: ignore[no-untyped-call]
    assert values == {"a": float(CHECK_EVERY - 1), "b": 2.0}
    assert os.stat(name).st_mode & 0o777 == 0o600
    d.close()
    # a process that opens a garbled file of its own name starts it again
    Path(name).write_bytes(struct.pack("<i", 2**31 - 1) + os.urandom(64))
    again = PwriteDict(name)
    again.write_value("c", 3.0, 0.0)
    assert {k: v for k, v, _, _ in MmapedDict.read_all_values_from_file(name)} == {"c": 3.0}  # type: ignore[no-untyped-call]
    again.close()


def test_two_threads_of_one_process_take_turns_under_the_lock(tmp_path: Path) -> None:
    """flock excludes other open files only: the event loop's admin command and a report-writing thread share one
    descriptor, and each read-modify-write must see the other's (no update lost)."""
    f = StateFile(tmp_path / "state.json")
    f.write({"n": 0, "events": []})
    per_thread = 200

    def bump() -> None:
        for _ in range(per_thread):
            with f.locked():
                doc = f.read()[1]
                assert doc is not None
                with f.locked():  # re-entrant: a helper that locks again inside one update
                    doc["n"] += 1
                    f.write(doc)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert f.read()[1] == {"n": 4 * per_thread, "events": []}
