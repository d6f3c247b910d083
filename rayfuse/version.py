"""The package version (its own module, so that submodules never import the ``rayfuse`` package itself)."""

__version__ = "0.1.0"
