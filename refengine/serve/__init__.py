"""The OpenAI-compatible HTTP server in front of one engine thread."""
from .server import OpenAIServer

__all__ = ["OpenAIServer"]
