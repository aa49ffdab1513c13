"""The X11 libraries Qt's xcb platform plugin needs, checked before the QApplication exists.

Without one of them Qt prints its own "Could not load the Qt platform plugin "xcb"" and aborts
(SIGABRT), and its hint names ``libxcb-cursor0`` whatever is really missing. KV Valet looks
first and says which libraries are missing and which packages hold them.

The list is what PySide6's ``plugins/platforms/libqxcb.so`` and ``lib/libQt6XcbQpa.so.6`` link
(their ``DT_NEEDED`` entries; ``tests/unit/test_gui_libs.py`` reads them from the installed wheel
so the list follows PySide6 upgrades), Qt's own libraries and glibc's aside. Qt 6 no longer links
``libxcb-xinerama``.

Test hook: ``KV_VALET_PRETEND_MISSING_LIBS=libxcb-cursor.so.0[,…]`` makes :func:`library_loads`
report those libraries missing, so the whole path (message, exit status) can be tested on a
machine that has them. Nothing else reads it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Mapping

#: soname -> (Debian/Ubuntu package, Fedora package)
XCB_LIBRARIES: dict[str, tuple[str, str]] = {
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
}

PRETEND_MISSING_ENV = "KV_VALET_PRETEND_MISSING_LIBS"

Loader = Callable[[str], bool]


def uses_xcb(environ: Mapping[str, str], platform: str = sys.platform) -> bool:
    """Whether Qt will start on its X11 (xcb) platform plugin: Linux, on an X display, with no
    ``QT_QPA_PLATFORM`` naming another platform first, and not in a Wayland session (Qt takes
    the wayland plugin there)."""
    if not platform.startswith("linux"):
        return False
    chosen = environ.get("QT_QPA_PLATFORM", "").strip()
    if chosen:  # "xcb", "wayland;xcb", "offscreen", "xcb:option=…": the first one is tried first
        return chosen.split(";")[0].split(":")[0].strip() == "xcb"
    if environ.get("XDG_SESSION_TYPE") == "wayland" and environ.get("WAYLAND_DISPLAY"):
        return False
    return bool(environ.get("DISPLAY"))


def missing_libraries(loads: Loader, names: Mapping[str, tuple[str, str]] = XCB_LIBRARIES) -> list[str]:
    """The sonames among ``names`` that ``loads`` says do not load, in the list's order."""
    return [name for name in names if not loads(name)]


def missing_message(missing: list[str], names: Mapping[str, tuple[str, str]] = XCB_LIBRARIES) -> str:
    """One message: what is missing, and the command that installs it on Debian/Ubuntu and Fedora."""
    debian = list(dict.fromkeys(names[m][0] for m in missing if m in names))
    fedora = list(dict.fromkeys(names[m][1] for m in missing if m in names))
    lines = [f"kv-valet: the window cannot open: Qt's X11 platform plugin (xcb) needs "
             f"{'a library' if len(missing) == 1 else 'libraries'} this system lacks: {', '.join(missing)}.",
             f"Install {'it' if len(missing) == 1 else 'them'}, then start kv-valet again:"]
    if debian:
        lines.append(f"  Debian/Ubuntu: sudo apt install {' '.join(debian)}")
    if fedora:
        lines.append(f"  Fedora:        sudo dnf install {' '.join(fedora)}")
    lines.append("The headless commands work without them: kv-valet serve default, kv-valet status URL, "
                 "kv-valet --help.")
    return "\n".join(lines)


def check(environ: Mapping[str, str], loads: Loader, platform: str = sys.platform) -> str | None:
    """The message to print instead of starting Qt, or None when the window can try."""
    if not uses_xcb(environ, platform):
        return None
    missing = missing_libraries(loads)
    return missing_message(missing) if missing else None


# -- the real loader ----------------------------------------------------------------------

def _pretend_missing() -> set[str]:
    value = os.environ.get(PRETEND_MISSING_ENV, "")
    return {part.strip() for part in value.replace(",", " ").split() if part.strip()}


@functools.cache
def _bundled_dirs() -> tuple[str, ...]:
    """Folders a bundle may keep the libraries in: the standalone build's (PyInstaller puts them
    next to the app) and PySide6's own Qt/lib."""
    dirs = []
    if getattr(sys, "frozen", False) and getattr(sys, "_MEIPASS", None):
        dirs.append(sys._MEIPASS)  # noqa: SLF001 (PyInstaller's documented attribute)
    try:
        import importlib.util

        spec = importlib.util.find_spec("PySide6")  # finds it without importing it
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.join(location, "Qt", "lib"))
    except (ImportError, ValueError):
        pass
    return tuple(dirs)


def library_loads(name: str) -> bool:
    """Whether the dynamic linker loads ``name`` (as Qt's plugin would), by its soname."""
    if name in _pretend_missing():
        return False
    for candidate in (name, *(os.path.join(d, name) for d in _bundled_dirs())):
        try:
            ctypes.CDLL(candidate)
            return True
        except OSError:
            continue
    return False
