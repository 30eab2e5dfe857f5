"""One builder per cache entry: a second process waits for the first's entry, then reads it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from firsttoken.cache_lock import building


def test_a_second_process_waits_for_the_builder_and_then_finds_its_entry(tmp_path):
    lock_file = str(tmp_path / "locks" / "entry.lock")
    entry = tmp_path / "entry"
    waiter_code = textwrap.dedent(f"""
        import logging, os, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        from firsttoken.cache_lock import building
        with building({lock_file!r}, "the entry"):
            print("entry found:", os.path.exists({str(entry)!r}), flush=True)
    """)
    with building(lock_file, "the entry"):
        waiter = subprocess.Popen([sys.executable, "-c", waiter_code], stdout=subprocess.PIPE, text=True)
        # Holding the lock until the waiter says it waits: the entry it finds is the one written here.
        assert waiter.stdout.readline().strip() == "waiting for another process building the entry"
        entry.write_text("built")
    remaining_output, _ = waiter.communicate(timeout=120)
    assert remaining_output.strip() == "entry found: True"
    assert waiter.returncode == 0


def test_where_no_lock_can_be_taken_the_build_goes_ahead_without_one(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    ran = []
    with building(str(not_a_folder / "entry.lock"), "the entry"):
        ran.append(True)
    assert ran == [True]
