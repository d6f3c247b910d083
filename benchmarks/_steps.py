"""Client steps of the round benchmark, in an importable module.

Ray workers find this module because Ray puts the driver script's folder (``benchmarks/``) on their ``sys.path``, so
the step is pickled by reference, as an installed method's steps are (a step defined in ``__main__`` would be
pickled by value on every call).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rayfuse.federation import Update, client_step

__all__ = ["echo_step"]


@client_step("bench.echo")
def echo_step(ctx: Any, global_params: dict[str, np.ndarray]) -> Update:
    """A client with no local training: return a copy of the broadcast (new memory, like a trained update).

    ``metrics["copy_s"]`` is the CPU time of the copy (the clients share the CPUs, so their wall time would count
    the time they wait for each other); ``train_seconds`` too, the one a secure round sums (its mean reaches the server).
    """
    start = time.thread_time()
    params = {k: v.copy() for k, v in global_params.items()}
    copy_s = time.thread_time() - start
    return Update(params=params, num_examples=ctx.num_examples, metrics={"copy_s": copy_s, "train_seconds": copy_s})
