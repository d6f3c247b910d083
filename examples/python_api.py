"""rayfuse from Python: a model and a fusion method defined in this script, run on a local Ray.

::

    python examples/python_api.py          # on Ray (a local one is started and stopped)
    python examples/python_api.py local    # in-process clients, no Ray

The same code runs in a notebook cell (docs/python-api.md shows it). The model class and the method travel to
the Ray actors by value.
"""

import sys

import numpy as np
from torch import nn

import rayfuse
from rayfuse.method import Method, MethodParams, MethodResult, MethodTags, Update, client_step
from rayfuse.models import get_params, predict_proba


class Net(nn.Module):
    """The clients' model: called as Net(input_shape, num_classes)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 32), nn.ReLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.head(self.body(x))


@client_step("example.local_model")
def local_model(ctx):
    """On each client: its trained local model and that model's accuracy on the client's own validation split."""
    model = ctx.local_model()
    accuracy = float((predict_proba(model, ctx.val.X).argmax(1) == ctx.val.y).mean()) if len(ctx.val) else 0.0
    return Update(get_params(model), ctx.num_examples, {"val_accuracy": accuracy})


class ValidationWeighted(Method):
    """One-shot fusion: the clients' local models averaged, each weighted by (its validation accuracy) ** power."""

    class Params(MethodParams):
        power: float = 2.0

    tags = MethodTags(uses_local_models=True)

    def run(self, server):
        updates = server.updates.receive(server.federation.run(local_model))  # validated, attacked where configured
        weights = np.array([u.metrics["val_accuracy"] for u in updates.values()]) ** self.params.power + 1e-12
        weights /= weights.sum()
        keys = next(iter(updates.values())).params
        fused = {k: sum(w * u.params[k] for w, u in zip(weights, updates.values())).astype(np.float32) for k in keys}
        return MethodResult(server.scoring.evaluate(fused), fused, {"weights": weights.round(3).tolist()})


config = {
    "run": {"name": "python-api"},
    "data": {"dataset": "digits"},
    "partition": {"method": "dirichlet", "num_clients": 4, "alpha": 0.5},
    "train": {"epochs": 10},
    "federation": {"ray_init": {"num_cpus": 2, "include_dashboard": False}},
    "methods": {"average": {}, "fedavg": {"rounds": 5, "local_epochs": 1}},  # registered methods, by name
}

backend = sys.argv[1] if len(sys.argv) > 1 else "ray"  # docs/python-api.md writes backend="ray"
result = rayfuse.run(config, model=Net, methods={"val-weighted": ValidationWeighted}, backend=backend, quiet=True)
print(result.metrics[["accuracy", "nll"]].round(4))  # one row per method label
fused = result.model("val-weighted")  # the fused nn.Module (result.models holds its parameters)
print(result.run_dir)
