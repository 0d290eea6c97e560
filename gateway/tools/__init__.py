"""The tools wing: Conveyor's server-side tools, run while the model is still writing their calls.

A model's tool call is parsed as it decodes; each argument or code statement
is handed to the tool as soon as it is complete (partial execution), and the
tool runs in a contained worker process, so its result is often ready when
the call's last token is.  The modules, bottom to top (each imports only
those above it in this list):

* :mod:`.base`: the declaration API plugin authors subclass (``Tool``,
  ``AsyncTool``, ``Granularity``) and the tool errors; exported by
  ``interlace``;
* :mod:`.worker`: the worker process: containment, the per-call CPU budget,
  serving one call after another; its ``CPUTimeExceeded`` and
  ``set_hard_limit`` are exported by ``interlace`` for tools that set limits;
* :mod:`.settings`: the timeouts, policy and lifecycle the runtime hands down
  to its pools and calls (instead of itself);
* :mod:`.process`: the worker's environment, killing its process tree;
* :mod:`.cgroup`: a per-call cgroup (memory, processes, CPU) counting every
  child, joined before the worker runs anything;
* :mod:`.sandbox`: the bubblewrap + setpriv + seccomp command line a
  sandboxed tool's worker starts under, and the probe that proves it holds;
* :mod:`.pool`: the gateway-side worker handles and their IPC, the fair queue
  of callers, one pool per tool;
* :mod:`.call`: one call's life (begin, field, line, finish, cancel) and its
  ``ToolResult``;
* :mod:`.runtime`: ``ToolRuntime``, the one object the gateway holds.
"""
