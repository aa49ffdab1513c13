"""Widgets and helpers every tab shares: theme, status bar, delegates, tasks, questions."""
