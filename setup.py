"""The optional C fast paths of the pool (kvguard._speedups).

Everything else is in pyproject.toml. Where no C compiler is at hand the build goes on
without the extension (``optional=True``) and kvguard runs its pure-Python paths, which
behave identically.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvguard._speedups", ["kvguard/_speedups.c"], optional=True),
    ]
)
