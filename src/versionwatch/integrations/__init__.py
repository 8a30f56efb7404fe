"""Integrations with training frameworks; each lives in its own submodule, imported on demand."""
