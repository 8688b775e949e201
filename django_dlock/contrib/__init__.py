"""Integrations with other libraries (each behind its own extra)."""
