"""The benchmarks' data files (README.md says what each is); no code.

A package so that setuptools installs the folder: it ships data only with a package listed in
``packages`` (pyproject.toml), and warned at every install while this was a plain folder.
"""
