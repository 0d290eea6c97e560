"""The Model Context Protocol wing, both ways (docs/mcp.md).

* :mod:`.client`: MCP servers as tool providers -- each configured server's
  tools become Interlace tools (``SERVER.TOOL``), registered through the
  plugin hook and run like any other tool;
* :mod:`.server`: Interlace's own tools served to MCP clients (``interlace mcp
  serve``, over stdio or streamable HTTP, with the gateway's keys and
  permissions).

Why one wing for both: they are the only modules that speak the official
``mcp`` SDK, and both translate between MCP's tool listings and results and
Interlace's :class:`~interlace.gateway.tools.base.Tool`; the rest of the
gateway sees tools only.  The gateway imports the client only when a
configuration names ``mcp_servers``.
"""
