"""Integrations with other frameworks, each an optional extra imported only by its own module."""
