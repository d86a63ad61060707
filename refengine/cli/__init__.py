"""The command line: the only layer that knows flag names."""
from .app import main

__all__ = ["main"]
