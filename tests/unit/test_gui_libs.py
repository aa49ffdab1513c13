"""Without the X libraries Qt's xcb plugin needs, ``kv-valet`` says which and how to install them
(issue #17), instead of Qt's own plugin error and an abort."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from app.ui import xcb_libs
from app.ui.xcb_libs import XCB_LIBRARIES, check, missing_libraries, missing_message, uses_xcb

X11 = {"DISPLAY": ":0"}


def loads_all_but(*missing):
    return lambda name: name not in missing


# -- the pure check ---------------------------------------------------------------------------

def test_a_missing_xcb_cursor_is_named_with_the_packages_that_hold_it():
    message = check(X11, loads_all_but("libxcb-cursor.so.0"), platform="linux")
    assert message is not None
    assert "libxcb-cursor.so.0" in message.splitlines()[0]
    assert "sudo apt install libxcb-cursor0\n" in message
    assert "sudo dnf install xcb-util-cursor\n" in message
    assert "kv-valet serve default" in message  # what works without a window


def test_every_missing_library_is_listed_once_and_each_package_once():
    missing = ["libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-shm.so.0", "libxcb-sync.so.1"]
    assert missing_libraries(loads_all_but(*missing)) == missing
    message = missing_message(missing)
    assert "lacks: libxcb-icccm.so.4, libxcb-keysyms.so.1, libxcb-shm.so.0, libxcb-sync.so.1." in message
    assert "sudo apt install libxcb-icccm4 libxcb-keysyms1 libxcb-shm0 libxcb-sync1\n" in message
    assert "sudo dnf install xcb-util-wm xcb-util-keysyms libxcb\n" in message  # libxcb holds both


def test_nothing_to_say_when_every_library_loads():
    assert check(X11, lambda name: True, platform="linux") is None


def test_no_library_is_asked_for_where_qt_does_not_use_xcb():
    asked = []

    def loads(name):
        asked.append(name)
        return False

    for environ, platform in (({"QT_QPA_PLATFORM": "offscreen", "DISPLAY": ":0"}, "linux"),
                              ({"QT_QPA_PLATFORM": "wayland;xcb", "DISPLAY": ":0"}, "linux"),
                              ({"XDG_SESSION_TYPE": "wayland", "WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0"}, "linux"),
                              ({"WAYLAND_DISPLAY": "wayland-0"}, "linux"),
                              (X11, "darwin"), (X11, "win32")):
        assert check(environ, loads, platform=platform) is None, environ
    assert asked == []


def test_xcb_is_expected_on_an_x_display_or_when_asked_for():
    assert uses_xcb({"DISPLAY": ":0"}, "linux")
    assert uses_xcb({"QT_QPA_PLATFORM": "xcb", "DISPLAY": ":0"}, "linux")
    assert uses_xcb({"QT_QPA_PLATFORM": "xcb:nograb", "DISPLAY": ":0"}, "linux")
    assert uses_xcb({"XDG_SESSION_TYPE": "x11", "DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, "linux")


def test_the_real_loader_finds_libc_and_honours_the_test_hook(monkeypatch):
    monkeypatch.delenv(xcb_libs.PRETEND_MISSING_ENV, raising=False)
    assert xcb_libs.library_loads("libc.so.6")
    assert not xcb_libs.library_loads("libkv-valet-no-such-library.so.7")
    monkeypatch.setenv(xcb_libs.PRETEND_MISSING_ENV, "libc.so.6, libm.so.6")
    assert not xcb_libs.library_loads("libc.so.6") and not xcb_libs.library_loads("libm.so.6")


# -- the list follows the plugin PySide6 ships -------------------------------------------------

def elf_needed(path: Path) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF file (what ``readelf -d`` lists)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, path
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, _entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strtab_offset + value
                needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the xcb plugin is Linux's")
def test_the_list_holds_every_x_library_the_installed_xcb_plugin_links():
    import importlib.util

    qt = Path(importlib.util.find_spec("PySide6").submodule_search_locations[0]) / "Qt"
    plugin, qpa = qt / "plugins" / "platforms" / "libqxcb.so", qt / "lib" / "libQt6XcbQpa.so.6"
    needed = set(elf_needed(plugin)) | set(elf_needed(qpa))
    assert "libxcb-cursor.so.0" in needed and "libQt6XcbQpa.so.6" in needed  # the reader reads
    system = {n for n in needed if not n.startswith("libQt6")}
    # glibc, the C++ runtime and GLib: any Linux that runs Python and QtCore has them
    base = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libglib-2.0.so.0",
            "libgthread-2.0.so.0", "libdl.so.2", "libpthread.so.0", "librt.so.1"}
    assert system - base - set(XCB_LIBRARIES) == set()


# -- the command, end to end -------------------------------------------------------------------

def test_kv_valet_without_libxcb_cursor_prints_the_packages_and_exits_nonzero(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY", "XDG_SESSION_TYPE")}
    # an X display is set (none answers there: the check comes before Qt is asked to connect)
    env.update(DISPLAY=":97", **{xcb_libs.PRETEND_MISSING_ENV: "libxcb-cursor.so.0"})
    r = subprocess.run([sys.executable, "-m", "app.cli"], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert r.returncode == 2, r.stderr
    # (a machine without other X libraries gets those named too)
    lines = r.stderr.splitlines()
    assert lines[0].startswith("kv-valet: the window cannot open") and "libxcb-cursor.so.0" in lines[0], r.stderr
    [apt] = [line.split() for line in lines if "sudo apt install" in line]
    [dnf] = [line.split() for line in lines if "sudo dnf install" in line]
    assert "libxcb-cursor0" in apt and "xcb-util-cursor" in dnf, r.stderr
    assert "Traceback" not in r.stderr and "Could not load the Qt platform plugin" not in r.stderr
    assert r.stdout == ""
