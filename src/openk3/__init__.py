"""openk3: the Kimi K3 system in Python."""

__version__ = "0.1.0"
