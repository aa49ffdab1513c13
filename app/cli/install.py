"""``kv-valet install-desktop | uninstall-desktop | install-service | uninstall-service``.

* The desktop entry, AppStream metainfo and icons go to the user's XDG folders
  (``$XDG_DATA_HOME``, default ``~/.local/share``), with ``Exec=`` pointing at
  this installation's ``kv-valet``.
* A systemd **user** unit runs ``kv-valet serve PROFILE``: systemd stops a unit
  with SIGTERM, and ``serve`` parks every slot that holds tokens before it stops
  the server, so a logout or a reboot parks the chats by itself.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from app import paths
from app import files
from app.cli.errors import CliError, Exit

APP_ID = "io.github.kvvalet.KVValet"
#: desktop entries, icons and units hold nothing secret, and the desktop's own tools read them
PUBLIC_FILE_MODE = 0o644
ROOT = Path(__file__).resolve().parents[2]  # the checkout (the supported install is `pip install -e .`)
ICON_SIZES = (16, 32, 48, 64, 128, 256)


def add_commands(sub) -> None:
    d = sub.add_parser("install-desktop", help="add KV Valet to the desktop's application menu (this user)")
    d.set_defaults(run=cmd_install_desktop)
    u = sub.add_parser("uninstall-desktop", help="remove what install-desktop added")
    u.set_defaults(run=cmd_uninstall_desktop)
    s = sub.add_parser("install-service", help="run 'kv-valet serve PROFILE' as a systemd user service that "
                                               "parks the slots when it is stopped (logout, reboot)")
    s.add_argument("profile")
    s.add_argument("--no-enable", action="store_true", help="only write the unit file")
    s.set_defaults(run=cmd_install_service)
    r = sub.add_parser("uninstall-service", help="stop, disable and remove that service")
    r.add_argument("profile")
    r.set_defaults(run=cmd_uninstall_service)


def _data_home() -> Path:
    return paths.xdg_data_home()


def _config_home() -> Path:
    return paths.xdg_config_home()


def kv_valet_executable() -> str:
    """This installation's ``kv-valet`` (next to the running interpreter), else the one on PATH."""
    beside = Path(sys.executable).with_name("kv-valet")
    return str(beside) if beside.is_file() else (shutil.which("kv-valet") or "kv-valet")


def desktop_files() -> dict[Path, bytes]:
    """Target path -> content of everything install-desktop writes."""
    src = ROOT / "packaging"
    if not (src / f"{APP_ID}.desktop").is_file():
        raise CliError(f"the desktop files are not in {src}: install KV Valet from its checkout "
                       "(pip install -e .)")
    home = _data_home()
    entry = (src / f"{APP_ID}.desktop").read_text(encoding="utf-8")
    entry = entry.replace("Exec=kv-valet", f"Exec={kv_valet_executable()}")
    out = {home / "applications" / f"{APP_ID}.desktop": entry.encode(),
           home / "metainfo" / f"{APP_ID}.metainfo.xml": (src / f"{APP_ID}.metainfo.xml").read_bytes(),
           home / "icons" / "hicolor" / "scalable" / "apps" / f"{APP_ID}.svg":
               (ROOT / "resources" / "kv-valet.svg").read_bytes()}
    for size in ICON_SIZES:
        out[home / "icons" / "hicolor" / f"{size}x{size}" / "apps" / f"{APP_ID}.png"] = \
            (ROOT / "resources" / "icons" / f"kv-valet-{size}.png").read_bytes()
    return out


def cmd_install_desktop(args) -> int:
    for path, content in desktop_files().items():
        files.write_atomic(path, content, mode=PUBLIC_FILE_MODE)
        print(f"wrote {path}")
    _run_if_present(["update-desktop-database", str(_data_home() / "applications")])
    return Exit.OK


def cmd_uninstall_desktop(args) -> int:
    for path in desktop_files():
        if path.exists():
            path.unlink()
            print(f"removed {path}")
    return Exit.OK


def unit_name(profile: str) -> str:
    safe = "".join(c if c.isalnum() or c in "_-." else "_" for c in profile)
    return f"kv-valet-{safe}.service"


def unit_text(profile: str) -> str:
    exe = kv_valet_executable()
    return f"""# Written by `kv-valet install-service {profile}`; `kv-valet uninstall-service {profile}` removes it.
[Unit]
Description=KV Valet: llama-server of profile {profile} (parks its slots when stopped)
After=network.target

[Service]
Type=exec
ExecStart={exe} serve {profile} --quiet
# systemd stops the unit with SIGTERM: serve parks every slot that holds tokens, then
# stops the server. Parking a 100K-token chat takes seconds; leave it room.
KillSignal=SIGTERM
TimeoutStopSec=150
Restart=on-failure

[Install]
WantedBy=default.target
"""


def _unit_path(profile: str) -> Path:
    return _config_home() / "systemd" / "user" / unit_name(profile)


def _run_if_present(argv: list[str]) -> subprocess.CompletedProcess | None:
    if shutil.which(argv[0]) is None:
        return None
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def cmd_install_service(args) -> int:
    from app.store.profiles import ProfileStore

    ProfileStore().load(args.profile)  # a clear error for an unknown profile
    path = _unit_path(args.profile)
    files.write_atomic(path, unit_text(args.profile), mode=PUBLIC_FILE_MODE)
    print(f"wrote {path}")
    if args.no_enable:
        print(f"enable it with: systemctl --user enable --now {unit_name(args.profile)}")
        return Exit.OK
    for argv in (["systemctl", "--user", "daemon-reload"],
                 ["systemctl", "--user", "enable", "--now", unit_name(args.profile)]):
        r = _run_if_present(argv)
        if r is None:
            raise CliError("systemctl is not available: the unit is written; enable it where systemd runs")
        if r.returncode != 0:
            raise CliError(f"{' '.join(argv)} failed: {(r.stderr or r.stdout).strip()}")
    print(f"enabled and started {unit_name(args.profile)}: stopping it (logout, reboot) parks the slots")
    return Exit.OK


def cmd_uninstall_service(args) -> int:
    path = _unit_path(args.profile)
    r = _run_if_present(["systemctl", "--user", "disable", "--now", unit_name(args.profile)])
    if r is not None and r.returncode != 0 and path.exists():
        print(f"note: systemctl could not disable it: {(r.stderr or r.stdout).strip()}", file=sys.stderr)
    if path.exists():
        path.unlink()
        print(f"removed {path}")
    else:
        print(f"no unit {path}")
    _run_if_present(["systemctl", "--user", "daemon-reload"])
    return Exit.OK
