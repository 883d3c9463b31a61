"""Lily's version, in a module of its own so that any layer can name it without importing the
package's entry points (`lily/__init__.py` loads `lily.api` on first use)."""

__version__ = "0.1.0"
