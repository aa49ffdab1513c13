"""The proxy's values live in :mod:`app.core.conversation` (the store keeps them too)."""

from app.core.conversation import *  # noqa: F401,F403
from app.core.conversation import __all__  # noqa: F401
