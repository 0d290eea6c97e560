"""A tiny plugin for the CLI tests: one tool that reports facts through ``Tool.info``."""

from interlace import Tool, hookimpl


class Probe(Tool):
    name = "probe"
    description = "does nothing; reports its isolation"

    def on_finish(self, arguments):
        return {}

    def info(self):
        return {"isolation": "none (test probe)", "limits": {"memory_mb": self.memory_mb}}


@hookimpl
def register_tools(register):
    register(Probe())
