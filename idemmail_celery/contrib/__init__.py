"""Integrations with frameworks, each an optional module that imports its framework itself."""
