"""Disk faults during a park, on the real server: a full disk, a read-only save folder, and
a catalog that cannot be opened or written (replaced by a folder, on a read-only mount,
on a full disk).

Each filesystem is made for the test: a tmpfs of a few MB (or an ext4 image on a loop
device), a read-only bind mount of the folder onto itself (root writes through chmod, not
through a read-only mount). Where the machine cannot mount, the test skips, and under CI
fails with the reason.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from app import paths
from app.store.catalog import Catalog, CatalogError
from tests.faults.helpers import (MORE, SHORT, Proc, Server, assert_consistent, cli, fill_up, read_only, small_fs,
                                  state_bytes)

pytestmark = pytest.mark.real_server


def test_disk_full_during_a_park(stock_profile, tmp_path):
    """The save folder's disk fills up with a megabyte left: the re-park is refused before the server
    writes anything (the park's size is predicted from the model, app.core.park_size) and says how much
    it needs; the old copy stays listed, byte-identical; with room again the park works. (A save that
    runs out of space half-way: tests/fake_server/test_park_resume.py::test_failed_park_keeps_previous_copy.)"""
    folder = tmp_path / "small"
    profile = stock_profile.replace(slot_save_path=str(folder) + "/")
    from app.store.profiles import ProfileStore

    ProfileStore().save(profile)

    async def go():
        with small_fs(folder, 12 * 1024 * 1024):
            srv = await Server(profile).start()
            try:
                await srv.fill(0)
                old = await srv.park(0, "chat")
                before = state_bytes(folder, old.state_file)
                await srv.fill(0, SHORT + MORE)
                filler = folder / "filler"  # not a state file: nobody lists it
                with open(filler, "wb") as f:
                    f.truncate(0)
                    f.write(b"\0" * (shutil.disk_usage(folder).free - 1024 * 1024))
                rc, out, err = await cli("park", "real", "--slot", "0", "--name", "chat")
                assert rc == 1, (out, err)
                assert f"slot 0: not parked: not enough space to park: the disk holding {folder} has " in out \
                       and "free, the park needs about 3." in out and "nothing was saved" in out, out
                assert sorted(p.name for p in folder.iterdir() if p.name.startswith("kvv-tmp-")) == []
                listed = assert_consistent([folder])
                assert listed["chat"].n_tokens == old.n_tokens
                assert state_bytes(folder, old.state_file) == before

                filler.unlink()  # room again: the park goes through
                rc, out, err = await cli("park", "real", "--slot", "0", "--name", "chat")
                assert rc == 0 and "parked slot 0 as 'chat'" in out, (out, err)
                listed = assert_consistent([folder])
                assert listed["chat"].n_tokens > old.n_tokens
            finally:
                await srv.aclose()

    asyncio.run(go())


def test_read_only_save_folder(stock_profile):
    """A park into a read-only folder fails with the reason and leaves the old copy; a resume
    from it works (a restore only reads)."""
    async def go():
        srv = await Server(stock_profile).start()
        try:
            await srv.fill(0)
            old = await srv.park(0, "chat")
            before = state_bytes(srv.save_dir, old.state_file)
            await srv.fill(0, SHORT + MORE)
            with read_only(srv.save_dir):
                rc, out, err = await cli("park", "real", "--slot", "0", "--name", "chat")
                assert rc == 1, (out, err)
                assert ("slot 0: not parked: the server refused to save slot 0: Unable to save slot (the folder "
                        f"{srv.save_dir} is read-only)") in out, out
                rc, out, err = await cli("resume", "real", "chat", "--slot", "1", "--yes")
                assert rc == 0 and f"resumed 'chat' into slot 1: {old.n_tokens:,} tokens" in out, (out, err)
                assert_consistent([srv.save_dir])
            assert state_bytes(srv.save_dir, old.state_file) == before
            rc, out, err = await cli("park", "real", "--slot", "0", "--name", "chat")
            assert rc == 0, (out, err)
            assert assert_consistent([srv.save_dir])["chat"].n_tokens > old.n_tokens
        finally:
            await srv.aclose()

    asyncio.run(go())


def test_catalog_cannot_be_opened_or_written(stock_profile, tmp_path):
    """The catalog replaced by a folder, then on a read-only mount, then on a full disk:
    every command says what is wrong with the catalog, no state file is touched, and once
    the catalog is back everything is listed as before."""
    async def go():
        srv = await Server(stock_profile).start()
        try:
            await srv.fill(0)
            old = await srv.park(0, "chat")
            before = state_bytes(srv.save_dir, old.state_file)
            await srv.fill(0, SHORT + MORE)
            catalog = paths.catalog_path()

            # 1. a folder where the catalog file was
            aside = catalog.with_name("aside")
            aside.mkdir()
            for f in catalog.parent.glob(catalog.name + "*"):
                f.rename(aside / f.name)
            catalog.mkdir()
            for args in (("sessions", "list"), ("park", "real", "--slot", "0", "--name", "chat")):
                rc, out, err = await cli(*args)
                assert rc == 1 and f"cannot open the session catalog {catalog}" in err, (args, out, err)
            assert sorted(f.name for f in srv.save_dir.iterdir()) == [old.state_file]
            catalog.rmdir()
            for f in aside.iterdir():
                f.rename(catalog.parent / f.name)
            assert assert_consistent([srv.save_dir])["chat"].n_tokens == old.n_tokens

            # 2. the catalog's folder read-only (sqlite cannot open a WAL database there: it needs
            # to create the -shm file next to it)
            with read_only(catalog.parent):
                for args in (("sessions", "list"), ("park", "real", "--slot", "0", "--name", "chat")):
                    rc, out, err = await cli(*args)
                    assert rc == 1 and f"cannot open the session catalog {catalog}" in err, (args, out, err)
                    assert f"(its folder {catalog.parent} is read-only)" in err, err
            assert sorted(f.name for f in srv.save_dir.iterdir()) == [old.state_file]
            assert state_bytes(srv.save_dir, old.state_file) == before

            # 3. the catalog's disk full, while the window (a Catalog held open) keeps its WAL and
            # -shm files: (a) before a park: refused before anything is saved; (b) between the
            # save and the commit: the park is undone at once, its journal entry stays (the
            # disk refuses that write too) and the next start with room clears it
            data = catalog.parent
            moved = tmp_path / "data-moved"
            shutil.copytree(data, moved)
            shutil.rmtree(data)
            with small_fs(data, 1024 * 1024):
                for f in moved.iterdir():
                    shutil.copy2(f, data / f.name) if f.is_file() else shutil.copytree(f, data / f.name)
                window = Catalog(catalog)
                try:
                    d = await Proc.driver(op="park", profile="real", slot=0, name="chat", pause="saved")
                    await d.expect("at saved")
                    fill_up(data)
                    rc, out, err = await cli("park", "real", "--slot", "0", "--name", "chat")
                    assert rc == 1 and f"cannot write the session catalog {catalog}" in err, (out, err)
                    d.send("go on")
                    rc, out, err = await d.finish()
                    assert rc == 1 and f"failed cannot write the session catalog {catalog}" in out, (out, err)
                    assert state_bytes(srv.save_dir, old.state_file) == before
                    assert sorted(f.name for f in srv.save_dir.iterdir()) == [old.state_file]
                    with pytest.raises(CatalogError, match="cannot write the session catalog"):
                        window.rename("real", "chat", "renamed")
                    (data / "filler").unlink()  # room again: the next start clears what was left
                    window.rename("real", "chat", "chat")  # the window's connection writes again
                finally:
                    window.close()
                rc, out, err = await cli("resume", "real", "chat", "--slot", "1", "--yes")
                assert rc == 0 and f"{old.n_tokens:,} tokens" in out, (out, err)
                assert "park of 'chat' was interrupted while saving" in err, err
                assert assert_consistent([srv.save_dir])["chat"].n_tokens == old.n_tokens
                rc, out, err = await cli("park", "real", "--slot", "0", "--name", "chat")
                assert rc == 0, (out, err)
                assert assert_consistent([srv.save_dir])["chat"].n_tokens > old.n_tokens
        finally:
            await srv.aclose()

    asyncio.run(go())
