"""``gems``: Model Aggregation via Good-Enough Model Spaces (Guha & Smith 2019) [1].

Each client describes the set of models that are *good enough* on its own validation data -- a ball (or a Fisher
ellipsoid) around its local optimum -- and the server returns a model in the intersection of all clients' sets.

**Convex models (logreg).** Client ``k`` builds ``H_k = {w : ||a_k (w - c_k)|| <= 1}`` around its local model ``c_k``
by a binary search on the radius (Algorithm 2; ``p`` models sampled on the surface must all reach validation
accuracy ``>= epsilon``, eq. 1), with the ellipsoid of App. A by default (axes ``max(min F / F_i, c)`` from the
diagonal Fisher ``F``). The server minimises eq. (2), ``sum_k max(0, ||a_k (w - c_k)|| - 1)``, and reports whether a
common point exists (``intersection_found``) and the distance left when it does not.

**Networks (MLP, any depth).** Layer by layer: every client builds one ball per hidden neuron ``[w_l, b_l]`` whose
test (eq. 3) bounds the change of the neuron's activations on its validation inputs,
``||act(X w' + b') - z_l||_2 / n <= epsilon_j``; the server clusters all clients' neurons with k-means into
``m_epsilon`` clusters and intersects greedily inside each cluster (neurons that meet no group are kept unchanged);
the fused layer is broadcast, the clients retrain the layers above on the fused features and repeat. The output layer
is a softmax regression every client trains on the fused features, fused as in the convex case.

The fused model is then fine-tuned on the server's public sample (``GEMS tuned``; last layer for networks), reported
as the ``tuned_*`` metrics. The same fine-tuning of the local / averaged models and a model trained on the public
sample alone are the ``tuned`` method (``base: local | average | raw``).

Ball construction runs inside the clients (client steps ``gems.model_ball`` and ``gems.neuron_balls``); the ``p``
sampled models of one radius, for all of a layer's neurons at once, are one batched tensor computation
(:mod:`rayfuse.fusion.gems.balls`).

[1] N. Guha, V. Smith. Model Aggregation via Good-Enough Model Spaces. arXiv:1805.07782 (2019). Defaults are the
paper's and its notebooks' ([GEMS] in docs/references.md; departures: docs/methods/gems.md).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator

from rayfuse.errors import InputError, key_error
from rayfuse.fusion import references
from rayfuse.fusion.baselines.finetune import TuneSettings, check_public_samples, check_tune_solver, evaluate_params, tuning_curve
from rayfuse.fusion.gems.balls import (
    cluster_neurons,
    compute_fisher,
    ellipsoid_axes,
    fisher_mask,
    flatten_linear,
    fuse_neurons,
    intersect_balls,
    neuron_distance,
    search_radii,
    softmax_accuracy,
    unflatten_linear,
)
from rayfuse.method import (
    ClientContext,
    Method,
    MethodCase,
    MethodResult,
    MethodTags,
    RunSetup,
    ServerContext,
    client_step,
    register_method,
)
from rayfuse.symmetry import ModelStructure, read_structure

__all__ = ["GEMS", "GEMSParams", "build_model_ball", "build_neuron_balls", "transform_features"]


# -----------------------------------------------------------------------------------------------------------------
# Client side


def transform_features(X: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]], activation: str = "relu") -> np.ndarray:
    """``X`` flattened and passed through the fused hidden layers ``act(x W^T + b)`` (float32)."""
    from rayfuse.fusion.gems.balls import _ACTIVATIONS

    out = torch.as_tensor(np.ascontiguousarray(X, dtype=np.float32).reshape(len(X), -1))
    with torch.no_grad():
        for weight, bias in layers:
            out = _ACTIVATIONS[activation](
                out @ torch.tensor(np.asarray(weight), dtype=torch.float32).T + torch.tensor(np.asarray(bias), dtype=torch.float32)
            )
    return out.numpy()


def _layer_arrays(model: torch.nn.Module, input_shape: tuple[int, ...], which: str) -> tuple[np.ndarray, np.ndarray]:
    """The weight and bias of ``model``'s first layer (``which="first"``) or output layer (``"output"``), found in its
    graph (:func:`rayfuse.symmetry.read_structure`), as numpy arrays."""
    from rayfuse.models import get_params

    structure = read_structure(model, torch.zeros((2, *input_shape)), spec=False)
    layer = structure.layers[0] if which == "first" else structure.output_layer
    params = get_params(model)
    weight = params[layer.weight]
    return weight, params[layer.bias] if layer.bias is not None else np.zeros(len(weight), weight.dtype)


def _config_structure(model_cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> ModelStructure:
    """The structure of the configured model (layer keys and hidden groups; the fused model's widths may differ)."""
    from rayfuse.models import build_model

    model = build_model(model_cfg, input_shape, num_classes, seed=0)
    return read_structure(model, torch.zeros((2, *input_shape)))


def _hidden_widths(structure: ModelStructure) -> list[int]:
    """The widths of the hidden layers GEMS fuses one by one: the sizes of their output units' permutation groups (a
    layer of one unit has no group: its one row)."""
    assert structure.spec is not None
    return [
        structure.spec.group(layer.out_group).size if layer.out_group is not None else structure.param_shapes[layer.weight][0]
        for layer in structure.hidden
    ]


@client_step("gems.model_ball")
def build_model_ball(
    ctx: ClientContext,
    fused_layers: list[tuple[np.ndarray, np.ndarray]] | None,
    *,
    label: str,
    epsilon: float,
    shape: str,
    floor: float,
    num_samples: int,
    r_max: float,
    tol: float,
    fisher_samples: int,
    fisher_prop: float,
    activation: str = "relu",
    retrain_epochs: int = 10,
    retrain_lr: float = 1e-3,
    retrain_batch_size: int = 32,
) -> dict[str, Any]:
    """The good-enough ball of a softmax regression (eq. 1, Algorithm 2, App. A).

    ``fused_layers`` ``None``: the client's local logreg model. Otherwise the client trains a fresh softmax
    regression on its data passed through the fused hidden layers (the output-layer round of the network variant).
    Returns the centre ``[W.ravel(), b]``, the radius, the ellipsoid axes / mask and the validation accuracy.
    """
    from rayfuse.models import train_model
    from rayfuse.models.registry import LogisticRegression

    started = time.perf_counter()
    if fused_layers is None:
        weight, bias = _layer_arrays(ctx.local_model(), tuple(ctx.input_shape), "output")
        X_val = ctx.val.X.reshape(len(ctx.val), -1)
    else:
        X_train = transform_features(ctx.train.X, fused_layers, activation)
        X_val = transform_features(ctx.val.X, fused_layers, activation)
        seed = ctx.step_seed(label, "output-layer")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = LogisticRegression(X_train.shape[1], ctx.num_classes)
        train_model(
            head, X_train, ctx.train.y, epochs=retrain_epochs, batch_size=retrain_batch_size, lr=retrain_lr, seed=seed, device=ctx.device
        )
        weight, bias = _layer_arrays(head, (X_train.shape[1],), "output")
    C, D = weight.shape
    center = flatten_linear(weight, bias)
    y_val = ctx.val.y
    rng = np.random.default_rng(ctx.step_seed(label, "ball", "final" if fused_layers else "convex"))
    fisher = compute_fisher(weight, bias, X_val, fisher_samples, rng) if len(y_val) else np.ones_like(center)
    axes = ellipsoid_axes(fisher, floor) if shape == "ellipsoid" else None
    mask = fisher_mask(fisher, fisher_prop) if fisher_prop < 1 else None

    def passes(samples: np.ndarray | torch.Tensor, _ids: np.ndarray) -> np.ndarray:
        return softmax_accuracy(samples, X_val, y_val, C, device=ctx.device) >= epsilon

    val_accuracy = float(softmax_accuracy(center[None, None, :], X_val, y_val, C, device=ctx.device)[0, 0]) if len(y_val) else 0.0
    search = search_radii(
        passes,
        center[None, :],
        num_samples=num_samples,
        r_max=r_max,
        tol=tol,
        rng=rng,
        axes=None if axes is None else axes[None, :],
        masks=None if mask is None else mask[None, :],
        dtype="float32",
        device=ctx.device,
    )
    return {
        "center": center,
        "radius": float(search.radius[0]),
        "shape": (C, D),
        "axes": axes,
        "mask": mask,
        "val_accuracy": val_accuracy,
        "steps": search.steps,
        "evaluations": search.evaluations,
        "seconds": time.perf_counter() - started,
    }


@client_step("gems.neuron_balls")
def build_neuron_balls(
    ctx: ClientContext,
    fused_layers: list[tuple[np.ndarray, np.ndarray]],
    *,
    label: str,
    layer: int,
    hidden: list[int],
    hidden_epsilon: float,
    num_samples: int,
    r_max: float,
    tol: float,
    activation: str = "relu",
    retrain_epochs: int = 10,
    retrain_lr: float = 1e-3,
    retrain_batch_size: int = 32,
) -> dict[str, Any]:
    """One ball per hidden neuron of layer ``layer`` (eq. 3 of [1]), all neurons searched at once.

    Layer 0 is the client's local model's first layer. For a deeper layer the client first retrains the layers above
    the fused ones (``hidden[layer:]`` and the classifier, a fresh MLP) on its data passed through ``fused_layers``
    (step 4 of the paper's network procedure) and takes that network's first layer.
    """
    from rayfuse.models import train_model
    from rayfuse.models.registry import MLP

    started = time.perf_counter()
    X_val = transform_features(ctx.val.X, fused_layers, activation)
    if layer == 0:
        weight, bias = _layer_arrays(ctx.local_model(), tuple(ctx.input_shape), "first")
    else:
        X_train = transform_features(ctx.train.X, fused_layers, activation)
        seed = ctx.step_seed(label, "retrain", layer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            above = MLP(X_train.shape[1], list(hidden[layer:]), ctx.num_classes, activation=activation)
        train_model(
            above, X_train, ctx.train.y, epochs=retrain_epochs, batch_size=retrain_batch_size, lr=retrain_lr, seed=seed, device=ctx.device
        )
        weight, bias = _layer_arrays(above, (X_train.shape[1],), "first")
    centers = np.concatenate([weight, bias[:, None]], axis=1).astype(np.float64)  # (H, D + 1) rows [w_l, b_l]
    targets = transform_features(X_val, [(weight, bias)], activation)  # z_l: the neuron's own activations, (n, H)
    rng = np.random.default_rng(ctx.step_seed(label, "neurons", layer))

    def passes(samples: np.ndarray | torch.Tensor, ids: np.ndarray) -> np.ndarray:
        return neuron_distance(samples, X_val, targets[:, ids], activation=activation, device=ctx.device) <= hidden_epsilon

    # One set of draws per step for all the layer's neurons (shared=True): each neuron's search sees p independent
    # uniform directions per radius, as in the reference; only different neurons' draws are correlated.
    search = search_radii(
        passes, centers, num_samples=num_samples, r_max=r_max, tol=tol, rng=rng, dtype="float32", device=ctx.device, shared=True
    )
    return {
        "centers": centers,
        "radii": search.radius,
        "steps": search.steps,
        "evaluations": search.evaluations,
        "seconds": time.perf_counter() - started,
    }


# -----------------------------------------------------------------------------------------------------------------
# Parameters


MAX_RADIUS_HALVINGS = 40  # r_max / tol <= 2^40: the radius search ends in at most 40 steps, far above float spacing


class GEMSParams(TuneSettings):
    epsilon: float | None = Field(
        None,
        ge=0,
        le=1,
        description="validation accuracy a model in a ball must reach "
        "(default 0.4 for logreg, Table 1; 0.7 for a network's output layer, Table 2)",
    )
    shape: Literal["auto", "sphere", "ellipsoid"] = Field(
        "auto", description="auto: the Fisher ellipsoid for logreg (Table 1), a sphere for a network's output layer (the reference code)"
    )
    floor: float = Field(0.1, gt=0, le=1, description="ellipsoid axis floor c (eq. 5)")
    num_samples: int = Field(500, ge=1, description="p: models sampled on the surface per radius")
    r_max: float = Field(4000.0, gt=0, description="R_max: upper end of the radius search")
    tol: float | None = Field(None, gt=0, description="Delta of the radius search (default 0.1 ellipsoid, 0.01 sphere)")
    fisher_samples: int = Field(200, ge=1, description="validation inputs of the empirical Fisher")
    fisher_prop: float = Field(1.0, gt=0, le=1, description="searched fraction of parameters (top Fisher values; 1: all)")
    hidden_epsilon: float | list[float] = Field(1.0, description="epsilon_j of eq. 3 (per hidden layer if a list)")
    m_epsilon: int | list[int] | None = Field(None, description="k-means clusters per hidden layer (default: the layer's width)")
    neuron_tol: float = Field(1.0, gt=0, description="Delta of the neurons' radius search (reference: 1.0)")
    skip_first_cluster: bool = Field(False, description="reproduce the reference code's bug that drops k-means cluster 0")
    retrain_epochs: int = Field(10, ge=1, description="clients' training of the layers above the fused ones (reference: 10)")
    retrain_lr: float = Field(1e-3, gt=0, description="Adam learning rate of that training (reference: 1e-3)")
    max_iter: int = Field(1000, ge=1, description="L-BFGS iterations of the intersection (eq. 2)")
    fine_tune: bool = Field(True, description="also report the fused model fine-tuned on the public sample (tuned_* metrics)")

    @field_validator("hidden_epsilon")
    @classmethod
    def _nonnegative(cls, value: float | list[float]) -> float | list[float]:
        values = value if isinstance(value, list) else [value]
        if not values or any(v < 0 for v in values):
            raise ValueError(f"distances >= 0, got {value}")
        return value

    @field_validator("m_epsilon")
    @classmethod
    def _positive(cls, value: int | list[int] | None) -> int | list[int] | None:
        values = [] if value is None else value if isinstance(value, list) else [value]
        if isinstance(value, list) and not value or any(v < 1 for v in values):
            raise ValueError(f"cluster counts >= 1, got {value}")
        return value

    @model_validator(mode="after")
    def _bounded_radius_search(self) -> GEMSParams:
        # The radius search halves [0, r_max] until it is narrower than tol: a tol too small against r_max takes
        # thousands of steps (each p sampled models per ball), and below r_max's float spacing it never ends.
        for key, tol in (("tol", self.tol), ("neuron_tol", self.neuron_tol)):
            if tol is not None and self.r_max / tol > 2.0**MAX_RADIUS_HALVINGS:
                raise key_error(
                    key,
                    f"at least r_max / 2^{MAX_RADIUS_HALVINGS} = {self.r_max / 2.0**MAX_RADIUS_HALVINGS:.3g} "
                    f"(the radius search halves [0, r_max = {self.r_max:g}] at most {MAX_RADIUS_HALVINGS} times), got {tol:g}",
                )
        return self


def _per_layer(value: Any, num_layers: int, path: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * num_layers
    if len(value) != num_layers:
        raise InputError(path, f"one value per hidden layer ({num_layers}) or a single value", value)
    return list(value)


def _check_same_shapes(results: dict[int, dict[str, Any]], key: str, what: str) -> None:
    shapes = {client: np.shape(r[key]) for client, r in results.items()}
    first_client, first = next(iter(shapes.items()))
    for client, shape in shapes.items():
        if shape != first:
            raise InputError(
                "model",
                "the same architecture on every client (GEMS fuses layer by layer)",
                f"{what}: client {first_client} {first}, client {client} {shape}",
            )


# -----------------------------------------------------------------------------------------------------------------
# Server


@register_method
class GEMS(Method[GEMSParams, None]):
    name = "gems"
    Params = GEMSParams
    summary = "good-enough model spaces: intersect clients' balls of good models (Guha & Smith 2019)"
    reference = references.GEMS
    tags = MethodTags(
        fuses="statistics",
        uses_local_models=True,
        public_sample=True,
        public_labels=True,  # fine-tunes the fused model on the public sample's labels (fine_tune, the tuned_* metrics)
    )
    test_case = MethodCase(
        {"tune_epochs": 1, "retrain_epochs": 1, "num_samples": 50}, {"data": {"public_size": 0.1}}, step="gems.model_ball"
    )

    @classmethod
    def tags_for(cls, params: GEMSParams | None = None) -> MethodTags:
        """It reads the server's public sample (and its labels) only to fine-tune: ``fine_tune: false`` reads none."""
        if params is not None and not params.fine_tune:
            return replace(cls.tags, public_sample=False, public_labels=False)
        return cls.tags

    @classmethod
    def check(cls, params: GEMSParams, setup: RunSetup) -> None:
        """The model (logreg or mlp), the per-layer settings against its hidden layers, ``m_epsilon`` against the
        neurons across clients, and the fine-tuning settings against the model and the public sample."""
        p = params
        cfg = setup.model
        if cfg.name not in ("logreg", "mlp"):
            raise InputError("model.name", "logreg or mlp for method gems", cfg.name)
        if p.fine_tune:
            check_tune_solver(p, cfg)
            if setup.public_size:  # without a public sample the tuning is skipped (and said so in the result)
                check_public_samples(p.public_samples, setup.public_size)
        if cfg.name != "mlp" or setup.input_shape is None or setup.num_classes is None:
            return  # (the shapes not known yet: a silo run before its survey, checked after it)
        hidden = _hidden_widths(_config_structure(cfg, setup.input_shape, setup.num_classes))
        _per_layer(p.hidden_epsilon, len(hidden), "hidden_epsilon")
        m_eps = _per_layer(p.m_epsilon, len(hidden), "m_epsilon")
        K = setup.num_clients
        if p.m_epsilon is not None and K > 1:
            for layer, (m, width) in enumerate(zip(m_eps, hidden)):
                if m > K * width:
                    raise InputError(
                        "m_epsilon",
                        f"at most the number of neurons of hidden layer {layer} across clients ({K} x {width} = {K * width})",
                        m,
                    )

    def run(self, server: ServerContext) -> MethodResult:
        cfg = server.models.model_cfg
        if cfg.name == "mlp" and cfg.activation != "relu":
            server.progress("gems: eq. 3 is stated for ReLU; using the model's activation " + cfg.activation)
        started = time.perf_counter()
        if cfg.name == "logreg":
            params, info = self._fuse_convex(server)
        else:
            params, info = self._fuse_network(server)
        info["fuse_seconds"] = round(time.perf_counter() - started, 3)
        metrics = evaluate_params(server, params)
        if "hidden_units" in info:
            metrics["hidden_units"] = float(sum(info["hidden_units"]))
        server.log(1, metrics)
        if self.params.fine_tune and len(server.data.public):
            tuned, curve, _ = tuning_curve(server, params, self.params, key=f"methods.{self.label}.public_samples")
            metrics.update({f"tuned_{k}": v for k, v in tuned.items()})
            info["tuning_curve"] = curve
            server.log(2, {f"tuned_{k}": v for k, v in tuned.items()})
        elif self.params.fine_tune:
            info["tuning"] = "skipped: no public sample (set data.public_size)"
        return MethodResult(metrics, params, info=info)

    # -- convex ------------------------------------------------------------------------------------------------

    def _ball_args(self, server: ServerContext, *, network: bool) -> dict[str, Any]:
        p = self.params
        shape = p.shape if p.shape != "auto" else ("sphere" if network else "ellipsoid")
        epsilon = p.epsilon if p.epsilon is not None else (0.7 if network else 0.4)
        tol = p.tol if p.tol is not None else (0.1 if shape == "ellipsoid" else 0.01)
        return dict(
            label=server.label,
            epsilon=epsilon,
            shape=shape,
            floor=p.floor,
            num_samples=p.num_samples,
            r_max=p.r_max,
            tol=tol,
            fisher_samples=p.fisher_samples,
            fisher_prop=p.fisher_prop,
            activation=server.models.model_cfg.activation,
            retrain_epochs=p.retrain_epochs,
            retrain_lr=p.retrain_lr,
        )

    def _intersect_model_balls(
        self, server: ServerContext, balls: dict[int, dict[str, Any]], shape: str
    ) -> tuple[np.ndarray, dict[str, Any]]:
        _check_same_shapes(balls, "center", "output layer parameters" if shape == "network" else "model parameters")
        rows = list(balls.values())
        centers = np.stack([r["center"] for r in rows])
        radii = np.array([r["radius"] for r in rows])
        axes = np.stack([r["axes"] for r in rows]) if rows[0]["axes"] is not None else None
        masks = np.stack([r["mask"] for r in rows]) if rows[0]["mask"] is not None else None
        for client, r in balls.items():
            if r["radius"] == 0.0:
                server.events.emit(
                    "gems_empty_ball",
                    f"client {client}: its own model fails epsilon on its validation "
                    f"split (accuracy {r['val_accuracy']:.3f}); lower epsilon",
                    method=server.label,
                    client=client,
                )
        result = intersect_balls(centers, radii, axes=axes, masks=masks, max_iter=self.params.max_iter)
        info = {
            "clients": list(balls),
            "radii": radii.round(4).tolist(),
            "intersection_found": result.found,
            "distance_left": result.distance_left,
            "intersection_iterations": result.iterations,
            "client_val_accuracy": [round(r["val_accuracy"], 4) for r in rows],
            "ball_seconds": [round(r["seconds"], 3) for r in rows],
            "ball_evaluations": [int(r["evaluations"]) for r in rows],
        }
        if not result.found:
            server.progress(
                f"gems: the good-enough balls do not intersect (distance left {result.distance_left:.4g}); "
                "using the closest point; lower epsilon for a common model"
            )
        return result.point, info

    def _fuse_convex(self, server: ServerContext) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        fed = server.federation
        args = self._ball_args(server, network=False)
        server.progress("gems: building good-enough balls on the clients")
        balls = fed.run(build_model_ball, None, **args).results
        point, info = self._intersect_model_balls(server, balls, "convex")
        C, D = next(iter(balls.values()))["shape"]
        weight, bias = unflatten_linear(point, C, D)
        info.update(shape=args["shape"], epsilon=args["epsilon"])
        output = _config_structure(server.models.model_cfg, server.data.input_shape, server.data.num_classes).output_layer
        return {output.weight: weight, **({output.bias: bias} if output.bias is not None else {})}, info

    # -- networks ----------------------------------------------------------------------------------------------

    def _fuse_network(self, server: ServerContext) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        p = self.params
        fed = server.federation
        structure = _config_structure(server.models.model_cfg, server.data.input_shape, server.data.num_classes)
        hidden = _hidden_widths(structure)
        K = fed.num_clients
        eps_hidden = _per_layer(p.hidden_epsilon, len(hidden), f"methods.{self.label}.hidden_epsilon")
        m_eps = _per_layer(p.m_epsilon, len(hidden), f"methods.{self.label}.m_epsilon")
        if K == 1:
            # One client: its good-enough space contains its own model, the intersection's natural answer. (Running the
            # neuron step would merge the client's own neurons with each other: there is no same-client constraint.)
            client, update = next(iter(server.updates.accept(server.updates.local_updates()).items()))
            return dict(update.params), {
                "clients": [client],
                "hidden_units": hidden,
                "local_hidden_units": hidden,
                "ensemble_hidden_units": hidden,
                "note": "one client: its local model",
            }
        fused: list[tuple[np.ndarray, np.ndarray]] = []
        layers_info = []
        for layer, width in enumerate(hidden):
            server.progress(f"gems: neuron balls of hidden layer {layer}", layer=layer)
            gathered = fed.run(
                build_neuron_balls,
                fed.put(fused),
                label=server.label,
                layer=layer,
                hidden=hidden,
                hidden_epsilon=eps_hidden[layer],
                num_samples=p.num_samples,
                r_max=p.r_max,
                tol=p.neuron_tol,
                activation=server.models.model_cfg.activation,
                retrain_epochs=p.retrain_epochs,
                retrain_lr=p.retrain_lr,
            )
            results = gathered.results
            _check_same_shapes(results, "centers", f"hidden layer {layer} [w, b]")
            clients = list(results)
            # Neuron-major order as in the reference: neuron i of client t at index i * K + t.
            centers = np.stack([results[c]["centers"] for c in clients], axis=1).reshape(-1, results[clients[0]]["centers"].shape[1])
            radii = np.stack([results[c]["radii"] for c in clients], axis=1).reshape(-1)
            m = m_eps[layer] if m_eps[layer] is not None else width
            labels = cluster_neurons(centers, min(m, len(centers)), random_state=server.step_seed("kmeans", layer) % (2**31))
            fusion = fuse_neurons(centers, radii, labels, skip_first_cluster=p.skip_first_cluster, max_iter=p.max_iter)
            weight = np.ascontiguousarray(fusion.vectors[:, :-1], dtype=np.float32)
            bias = np.ascontiguousarray(fusion.vectors[:, -1], dtype=np.float32)
            fused.append((weight, bias))
            merged = [g for g in fusion.groups if len(g) > 1]
            layers_info.append(
                {
                    "layer": layer,
                    "units": len(fusion.groups),
                    "clusters": int(m),
                    "merged_units": len(merged),
                    "neurons_merged": int(sum(len(g) for g in merged)),
                    "unmatched": len(fusion.groups) - len(merged),
                    "merged_found": int(sum(fusion.found)),
                    "dropped": len(fusion.dropped),
                    "radius_median": float(np.median(radii)),
                    "radius_max": float(np.max(radii)),
                    "ball_seconds": [round(results[c]["seconds"], 3) for c in clients],
                }
            )
        server.progress("gems: output layer balls on the fused features")
        args = self._ball_args(server, network=True)
        balls = fed.run(build_model_ball, fed.put(fused), **args).results
        point, info = self._intersect_model_balls(server, balls, "network")
        C, D = next(iter(balls.values()))["shape"]
        out_w, out_b = unflatten_linear(point, C, D)
        params: dict[str, np.ndarray] = {}
        for graph_layer, (w, b) in zip([*structure.hidden, structure.output_layer], [*fused, (out_w, out_b)], strict=True):
            params[graph_layer.weight] = w
            if graph_layer.bias is not None:
                params[graph_layer.bias] = b
        info.update(
            shape=args["shape"],
            epsilon=args["epsilon"],
            hidden_units=[len(b) for _, b in fused],
            layers=layers_info,
            local_hidden_units=hidden,
            ensemble_hidden_units=[K * h for h in hidden],
        )
        return params, info
