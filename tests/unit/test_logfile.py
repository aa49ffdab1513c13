"""The server's log file rotates and never raises on the write path."""

from app.server.logfile import ServerLogFile


def test_rotates_at_the_size_limit_and_keeps_three_older_files(tmp_path):
    f = ServerLogFile(tmp_path / "logs" / "p.log", max_bytes=1000, backups=3)
    f.open("start")
    for i in range(200):
        f.write(f"line {i:04d} " + "x" * 40)
    f.close()
    names = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert names == ["p.log", "p.log.1", "p.log.2", "p.log.3"]
    assert all((tmp_path / "logs" / n).stat().st_size <= 1000 for n in names)
    assert (tmp_path / "logs" / "p.log").read_text().rstrip().endswith("line 0199 " + "x" * 40)


def test_writes_after_close_are_ignored(tmp_path):
    f = ServerLogFile(tmp_path / "p.log")
    f.open()
    f.write("a")
    f.close()
    f.write("b")
    assert (tmp_path / "p.log").read_text() == "a\n"


def test_a_lowered_retention_drops_the_older_files_and_zero_backups_still_bounds_the_file(tmp_path):
    logs = tmp_path / "logs"
    f = ServerLogFile(logs / "p.log", max_bytes=1000, backups=5)
    f.open("start")
    for i in range(300):
        f.write(f"line {i:04d} " + "x" * 40)
    f.close()
    assert (logs / "p.log.5").exists()
    f = ServerLogFile(logs / "p.log", max_bytes=1000, backups=2)  # the preference lowered, then a new launch
    f.open("again")
    f.close()
    assert sorted(p.name for p in logs.iterdir()) == ["p.log", "p.log.1", "p.log.2"]
    f = ServerLogFile(logs / "p.log", max_bytes=1000, backups=0)
    f.open("none kept")
    for i in range(300):
        f.write(f"more {i:04d} " + "y" * 40)
    f.close()
    assert sorted(p.name for p in logs.iterdir()) == ["p.log"]
    assert (logs / "p.log").stat().st_size <= 1000
    assert (logs / "p.log").read_text().rstrip().endswith("more 0299 " + "y" * 40)
