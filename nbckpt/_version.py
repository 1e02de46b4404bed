"""The version of nbckpt: at the bottom, so that every layer can name it without importing the top."""

__all__ = ["__version__"]

__version__ = "0.1.0"
