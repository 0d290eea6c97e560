"""What the tests share besides fixtures: modules a test imports (``from helpers import run``,
``from helpers.gateway_server import LiveGateway``) and the programs some start.

pytest's ``pythonpath`` option (pyproject: ``pythonpath = ["tests"]``) puts tests/ on ``sys.path``,
so this package imports by its name under any import mode, with no ``sys.path`` edits in the tests;
fixtures stay in tests/conftest.py.  The modules:

* ``gateway_server`` -- a real gateway on loopback, or ``interlace serve`` in a subprocess;
* ``tiny_models`` -- tiny random Hugging Face checkpoints (the ``tiny_dirs`` fixture makes them);
* ``info_plugin`` -- a plugin module a config names (``helpers.info_plugin``) for the CLI tests;
* ``mcp_test_server`` -- an MCP server the MCP tests run as a program;
* ``profiles`` -- small cost-model profiles the policy and simulator tests share.

Importing this package stays light (a subprocess loads ``helpers.info_plugin`` through it).
"""

import asyncio


def run(coro):
    """Run ``coro`` to completion on a new event loop (a synchronous test awaiting the engine)."""
    return asyncio.run(coro)
