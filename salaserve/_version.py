"""The package version, importable from every layer (the package's `__init__` re-exports it)."""

__version__ = "0.1.0"
