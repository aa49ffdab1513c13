"""KV Valet: park and resume llama-server sessions."""

__version__ = "0.1.0"
