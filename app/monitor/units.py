"""The monitor's units: moved to :mod:`app.core.units` (one byte and one duration formatter
for the whole app); re-exported here for the monitor modules that import them from here."""

from __future__ import annotations

from app.core.units import *  # noqa: F401,F403
from app.core.units import __all__  # noqa: F401
