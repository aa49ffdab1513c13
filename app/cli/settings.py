"""``kv-valet settings [set KEY=VALUE … | reset [KEY …]]``: the preferences without a window."""

from __future__ import annotations

import dataclasses

from app.cli.errors import CliError, Exit


def add_commands(sub) -> None:
    st = sub.add_parser("settings", help="show or change the preferences (the window's Preferences dialog)")
    sts = st.add_subparsers(dest="action")
    sts.add_parser("show", help="every setting, its value and what it does (the default action)")
    se = sts.add_parser("set", help="change settings: kv-valet settings set monitor_interval_s=0.5 keep_in_tray=true")
    se.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    rs = sts.add_parser("reset", help="back to the default (all settings when no key is given)")
    rs.add_argument("keys", nargs="*", metavar="KEY")
    st.set_defaults(run=cmd_settings)


def cmd_settings(args) -> int:
    from app import settings

    path = settings.settings_path()
    action = args.action or "show"
    try:
        if action == "set":
            changes = {}
            for item in args.assignments:
                key, sep, value = item.partition("=")
                if not sep:
                    raise CliError(f"'{item}' is not KEY=VALUE", Exit.USAGE)
                changes[key.strip()] = value.strip()
            try:
                settings.update(path, **changes)
            except ValueError as e:
                raise CliError(str(e), Exit.USAGE) from None
        elif action == "reset":
            unknown = [k for k in args.keys if k not in settings.FIELDS]
            if unknown:
                raise CliError(f"unknown setting(s): {', '.join(unknown)}", Exit.USAGE)
            current = settings.load(path)
            keys = args.keys or list(settings.FIELDS)
            settings.save(dataclasses.replace(current, **{k: getattr(settings.DEFAULTS, k) for k in keys}), path)
        current = settings.load(path)
    except settings.SettingsError as e:
        raise CliError("settings not saved" if action != "show" else "the settings file is not usable",
                       details=[f"{k}: {m}" for k, m in e.errors]) from None
    print(f"# {path}")
    for key in settings.FIELDS:
        value = getattr(current, key)
        shown = settings.as_toml(value)
        mark = "" if value == getattr(settings.DEFAULTS, key) else "   (changed)"
        print(f"{key} = {shown}{mark}")
        print(f"    {settings.describe(key)}")
    print(f"# {data_folder_note(current)}")
    return Exit.OK


def data_folder_note(current) -> str:
    from app.settings import data_folder_status

    return data_folder_status(current)
