"""A session name cannot escape its save folder (issue #21, part 4): whatever the name (``../x``,
an absolute path, ``/``, NUL, control characters, a thousand characters, any script), the file
it is parked to is one plain name inside the save folder, that llama-server's
``fs_validate_filename`` accepts and the file system can hold with every suffix KV Valet adds.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

from hypothesis import example, given, strategies as st

from app.sessions.park import pick_state_file, slugify
from app.sessions.park_commit import TMP_PREFIX
from app.store.catalog import Catalog
from tests.fuzz.fuzzkit import outcome

NAME_MAX = 255  # bytes, Linux file systems
#: the longest name KV Valet derives from a state file: "<slug>-999.bin" + ".checkpoints" (+ ".tmp")
LONGEST_SUFFIX = "-999.bin.checkpoints.tmp"


def fs_validate_filename(name: str) -> bool:
    """llama.cpp common.cpp fs_validate_filename (allow_subdirs false), which the server runs on
    the file name of every slot save and restore."""
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate is not UTF-8
        return False
    if not raw or len(raw) > NAME_MAX:
        return False
    for ch in name:
        c = ord(ch)
        if (c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or c in (0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF)
                or 0xD800 <= c <= 0xDFFF or ch in ':*?"<>|/\\'):
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."


TRICKY = st.sampled_from(["../x", "..", ".", "/", "/etc/passwd", "a/../../b", "x\0y", "\0", "\n", "\t\r",
                          "kvv-tmp-1", "kvv-tmp-abc.bin", " ", "-", "…", "a" * 119 + ".b", "é" * 200,
                          "\U0001d49c" * 200, "\u202e", "x\u2215y", "con", "a:b", "nul\x7f"])
NAMES = st.one_of(TRICKY, st.text(max_size=40), st.text(max_size=1000),
                  st.text(string.printable, max_size=300), st.lists(TRICKY, max_size=5).map("".join))


def stays_inside(folder: Path, file_name: str) -> None:
    assert fs_validate_filename(file_name), file_name
    assert "/" not in file_name and "\0" not in file_name
    path = folder / file_name
    assert path.parent == folder and os.path.normpath(path) == str(path)
    assert path.resolve().parent == folder.resolve()


@given(NAMES)
@example("a" * 119 + ".b")  # cut at 120 characters it ended in "." : "<...>..bin", which the server refuses
@example("\U0001d49c" * 200)  # 120 four-byte characters: a 484-byte file name
def test_every_name_maps_to_a_file_inside_the_folder(tmp_path_factory, name):
    folder = tmp_path_factory.getbasetemp() / "names"
    folder.mkdir(exist_ok=True)
    kind, slug = outcome("session name", lambda: slugify(name))  # never refused: always a safe name
    assert slug and not slug.startswith(TMP_PREFIX)
    for file_name in (f"{slug}.bin", f"{slug}-999.bin", f"{slug}{LONGEST_SUFFIX}"):
        stays_inside(folder, file_name)


@given(st.lists(NAMES, min_size=1, max_size=4))
def test_picked_file_names_stay_inside_and_never_collide(tmp_path_factory, names):
    folder = tmp_path_factory.mktemp("pick")
    with Catalog(":memory:") as cat:
        picked = []
        for name in names:
            kind, file_name = outcome("session name", lambda n=name: pick_state_file(cat, folder, "p", n))
            stays_inside(folder, file_name)
            (folder / file_name).write_bytes(b"")  # taken now: the next one must pick another
            picked.append(file_name)
        assert len(set(picked)) == len(picked)
