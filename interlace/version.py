"""The installed Interlace's version, in one place.

The plugin listing (``GET /v1/plugins``, ``interlace plugins``) reports it
for the built-in plugins, and the MCP server reports it in its handshake.
``interlace.__version__`` is the same value.  It is read from the
distribution's metadata, so pyproject.toml is the one place it is written
and there is nothing to bump here.  A source tree that is not installed
reports ``0+unknown``.  Like the whole public package, this module does not
import torch.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["__version__"]


def _installed_version() -> str:
    try:
        return metadata.version("interlace")
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()
