"""Benchmarks: ``interlace bench engine``, ``interlace bench tools`` and
``python -m interlace.bench.parsers``.  Results go to docs/benchmarks.md.

Every benchmark records the machine it ran on with
:func:`interlace.engine_ext.machine.machine` (saved in its JSON) and prints
:func:`~interlace.engine_ext.machine.describe_machine` above its table.
"""
