"""Dialogs: build, check and A/B, load check, host, move, preferences, the first-run guide."""
