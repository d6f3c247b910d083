"""The update layer: the framework's path from a round's client replies to an aggregate, below the engine and above
the maths, shared by every method (the methods themselves live in :mod:`rayfuse.fusion`).

- :mod:`~rayfuse.updates.pipeline`: :class:`~rayfuse.updates.pipeline.UpdatePipeline` (``server.updates``): validation,
  simulated attacks, clipping and central DP, the aggregation rule, its pre-start checks and its record;
- :mod:`~rayfuse.updates.streaming`: the one reply fold (a running sum a round's replies are added to as they arrive,
  in the coordinator, in each actor hosting several clients and on each node);
- :mod:`~rayfuse.updates.robust`: the aggregation rules (mean, median, trimmed mean, Krum, Bulyan, geometric median);
- :mod:`~rayfuse.updates.central_dp` and :mod:`~rayfuse.updates.privacy`: central DP-FedAvg and the one-shot DP upload,
  with :mod:`~rayfuse.updates.accountant` (the privacy accountant glue);
- :mod:`~rayfuse.updates.attacks`: simulated attacks on clients' updates (``federation.attacks``);
- :mod:`~rayfuse.updates.secagg`: secure aggregation, the SecAgg+ protocol's clients and server (the server learns
  only the sum);
- :mod:`~rayfuse.updates.aggregate`: the averaging maths.

It imports the method contract (:mod:`rayfuse.method`) and never a method or the engine (``tests/test_layering.py``).
"""
