"""rayfuse: federated model fusion on Ray.

The core (``rayfuse.fusion``, ``rayfuse.data``, ``rayfuse.models`` and the modules beside them) never imports Ray;
the Ray layer lives in the ``actors`` package. ``rayfuse run`` / ``rayfuse list`` are the command line.
"""

__version__ = "0.1.0"
