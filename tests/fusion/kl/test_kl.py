"""KL-fusion: homogeneous and heterogeneous fusion invariants, the GMM application end to end, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from rayfuse.errors import InputError
from rayfuse.expfam import DiagGaussian, Dirichlet, NormalWishart
from rayfuse.fusion.kl.fusion import fuse_heterogeneous, fuse_homogeneous, hausdorff, kl_kmeanspp
from rayfuse.fusion.kl.spahm import spahm_match
from rayfuse.matching import serial_map, thread_map
from rayfuse.method import METHODS
from rayfuse.runner import prepare_run


def planted(rng, G=6, d=3, D=8, noise=0.05, scale=10.0, subsets=True):
    """Well-separated diagonal-Gaussian atoms; each dataset holds a noisy subset (or all) of them, permuted."""
    truth = rng.normal(0, scale, (G, d))
    posteriors, atoms = [], []
    for _ in range(D):
        idx = rng.choice(G, size=int(rng.integers(2, G + 1)), replace=False) if subsets else rng.permutation(G)
        posteriors.append(DiagGaussian(truth[idx] + rng.normal(0, noise, (len(idx), d)), np.full((len(idx), d), 0.1)))
        atoms.append(idx)
    return truth, posteriors, atoms


def test_fusing_identical_posteriors_returns_them():
    rng = np.random.default_rng(0)
    base = NormalWishart(
        rng.normal(0, 10, (4, 2)), [50.0, 80, 60, 90], [40.0, 50, 60, 70], np.stack([np.eye(2) * s for s in (0.1, 0.2, 0.3, 0.4)])
    )
    copies = [base.take(np.arange(4)) for _ in range(5)]
    for solver in ("exact", "relaxed"):
        result = fuse_heterogeneous(copies, solver=solver)
        assert result.num_globals == 4
        order = np.argsort(result.globals.means()[:, 0])
        want = np.argsort(base.mean[:, 0])
        np.testing.assert_allclose(result.globals.natural()[order], base.natural()[want], rtol=1e-6, atol=1e-8)
    homo = fuse_homogeneous(copies)
    np.testing.assert_allclose(homo.globals.natural(), base.natural(), rtol=1e-9)
    assert all((a == np.arange(4)).all() for a in homo.assignments)


def test_a_planted_permutation_is_recovered_exactly():
    rng = np.random.default_rng(1)
    truth, posteriors, atoms = planted(rng, subsets=False)
    result = fuse_homogeneous(posteriors, executor=thread_map)
    # every dataset's component l (atom atoms[j][l]) goes to the global that dataset 0's copy of that atom went to
    of_atom = {int(a): int(g) for a, g in zip(atoms[0], result.assignments[0])}
    for idx, assign in zip(atoms, result.assignments):
        assert [of_atom[int(a)] for a in idx] == assign.tolist()
    assert hausdorff(result.globals.means(), truth) < 0.1


def test_heterogeneous_fusion_infers_the_number_of_components():
    rng = np.random.default_rng(2)
    truth, posteriors, atoms = planted(rng)
    used = np.unique(np.concatenate(atoms))
    for solver in ("exact", "relaxed"):
        result = fuse_heterogeneous(posteriors, solver=solver, random_state=0)
        assert result.num_globals == len(used), solver
        assert hausdorff(result.globals.means(), truth[used]) < 0.2
        # one dataset's components go to distinct globals
        assert all(len(set(a.tolist())) == len(a) for a in result.assignments)


def test_binary_and_relaxed_solvers_agree_on_an_easy_problem():
    rng = np.random.default_rng(3)
    truth, posteriors, atoms = planted(rng, G=4, D=6)
    exact = fuse_heterogeneous(posteriors, solver="exact")
    relaxed = fuse_heterogeneous(posteriors, solver="relaxed")
    assert exact.num_globals == relaxed.num_globals
    e, r = exact.globals.means(), relaxed.globals.means()
    assert hausdorff(e, r) < 1e-3
    # the relaxed P is (near) binary here and groups the same components
    for _a, P in zip(exact.assignments, relaxed.weights):
        assert np.abs(P.max(1) - 1).max() < 1e-3
    assert exact.objective[-1] <= exact.objective[0] + 1e-9


def test_parallel_and_serial_sweeps_give_the_same_fusion():
    rng = np.random.default_rng(4)
    _, posteriors, _ = planted(rng, G=8, D=12, noise=0.5, scale=3.0)
    a = fuse_heterogeneous(posteriors, executor=serial_map, random_state=5)
    b = fuse_heterogeneous(posteriors, executor=thread_map, random_state=5)
    np.testing.assert_allclose(a.globals.natural(), b.globals.natural())
    assert [x.tolist() for x in a.assignments] == [x.tolist() for x in b.assignments]
    assert (np.diff(a.objective) <= 1e-9 * abs(a.objective[0])).all()  # eq. (9) never increases over the sweeps


def test_kl_kmeanspp_picks_one_centre_per_well_separated_cluster():
    rng = np.random.default_rng(6)
    truth, posteriors, _ = planted(rng, G=5, subsets=False)
    from rayfuse.expfam import concat

    flat = concat(posteriors)
    centres = flat.take(kl_kmeanspp(flat, 5, rng))
    assert hausdorff(centres.means(), truth) < 0.3


def test_dirichlet_topics_fuse():
    rng = np.random.default_rng(7)
    topics = rng.dirichlet(np.full(30, 0.1), size=5) * 500 + 0.01
    posteriors = [
        Dirichlet(topics[idx] * rng.uniform(0.9, 1.1, (len(idx), 30)))
        for idx in (np.array([0, 1, 2]), np.array([2, 3, 4]), np.array([0, 4]))
    ]
    result = fuse_heterogeneous(posteriors)
    assert result.num_globals == 5


def test_spahm_recovers_well_separated_atoms():
    rng = np.random.default_rng(8)
    truth, posteriors, atoms = planted(rng, G=5, D=10)
    means, assign = spahm_match([p.means() for p in posteriors])
    used = np.unique(np.concatenate(atoms))
    assert len(means) == len(used) and hausdorff(means, truth[used]) < 0.2


BAD = [
    ("empty", lambda: fuse_heterogeneous([]), "posteriors"),
    ("mixed families", lambda: fuse_heterogeneous([DiagGaussian([[0.0]], [[1.0]]), Dirichlet([[1.0, 2.0]])]), r"posteriors\[1\]"),
    (
        "wrong dims",
        lambda: fuse_heterogeneous([DiagGaussian([[0.0]], [[1.0]]), DiagGaussian([[0.0, 1.0]], [[1.0, 1.0]])]),
        r"posteriors\[1\]",
    ),
    ("solver", lambda: fuse_heterogeneous([DiagGaussian([[0.0]], [[1.0]])], solver="cvxpy"), "solver"),
    ("lambda", lambda: fuse_heterogeneous([DiagGaussian([[0.0]], [[1.0]])], lam=-1.0), "lam"),
    ("G_init", lambda: fuse_heterogeneous([DiagGaussian(np.zeros((3, 1)), np.ones((3, 1)))], n_init_components=2), "n_init_components"),
    (
        "homogeneous sizes",
        lambda: fuse_homogeneous([DiagGaussian(np.zeros((3, 1)), np.ones((3, 1))), DiagGaussian([[0.0]], [[1.0]])]),
        "same number",
    ),
    ("not a batch", lambda: fuse_heterogeneous([np.zeros((2, 2))]), r"posteriors\[0\]"),
]


@pytest.mark.parametrize("name,call,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_error(name, call, match):
    with pytest.raises(InputError, match=match):
        call()


# -----------------------------------------------------------------------------------------------------------------
# The GMM application through the engine (in-process clients)

GMM = {
    "run": {"name": "klgmm", "seed": 0},
    "data": {"dataset": "kl_gmm", "options": {"separation": 30.0, "local_sd": 0.1, "points": 200, "num_groups": 5}, "val_size": 0},
    "partition": {"method": "labels", "num_clients": 5, "groups": [[0], [1], [2], [3], [4]]},
}


def test_gmm_job_recovers_the_true_number_of_components(coordinator):
    methods = {
        "kl": {"n_init": 2},
        "kl-relaxed": {"method": "kl", "solver": "relaxed", "n_init": 2},
        "spahm": {"n_init": 2},
        "dp_cluster": {"n_init": 2},
        "gmm_oracle": {"n_init": 2},
    }
    coord = coordinator(**GMM, methods=methods)
    out = {label: coord.run_method(label) for label in methods}
    for label in ("kl", "kl-relaxed", "gmm_oracle"):
        assert out[label]["metrics"]["size_error"] == 0.0, label
        assert out[label]["metrics"]["hausdorff"] < 0.5, label
    for entry in out.values():
        assert np.isfinite(list(entry["metrics"].values())).all()
    assert out["kl"]["info"]["global_components"] == out["kl"]["info"]["true_components"]
    # the local fits are made once per client and shared by every method of the run
    client = coord.federation.client(0)
    assert len([k for k in client.ctx.state if k[0] == "kl.gmm_posterior"]) == 1


def test_local_posteriors_are_computed_once_per_model_cache(coordinator, tmp_path):
    # A Tune sweep over lambda: every trial's run shares run.model_cache, the clients fit their posteriors once.
    cache = str(tmp_path / "cache")
    first = coordinator(**{**GMM, "run": {**GMM["run"], "model_cache": cache}}, methods={"kl": {"n_init": 1}})
    a = first.run_method("kl")
    assert any(e["kind"] == "step_results_cached" for e in first.events.since(0))
    second = coordinator(**{**GMM, "run": {**GMM["run"], "model_cache": cache}}, methods={"kl": {"n_init": 1, "lam": 0.5}})
    b = second.run_method("kl")
    assert any(e["kind"] == "step_results_restored" for e in second.events.since(0))
    assert not [k for k in second.federation.client(0).ctx.state if k[0] == "kl.gmm_posterior"]  # nothing fitted
    assert a["info"]["local_components"] == b["info"]["local_components"]
    # a fault injected into the step is part of the key: the faulty run fits again
    third = coordinator(
        **{**GMM, "run": {**GMM["run"], "model_cache": cache}},
        methods={"kl": {"n_init": 1}},
        federation={"faults": [{"client": 1, "step": "kl.gmm_posterior", "mode": "nan"}]},
    )
    assert third.run_method("kl")["info"]["clients"] == [0, 2, 3, 4]


@pytest.mark.parametrize(
    "key,value", [("lam", -1.0), ("n_components", 0), ("solver", "cvxpy"), ("application", "hmm"), ("executor", "gpu")]
)
def test_bad_method_parameters_name_their_key(make_config, key, value):
    with pytest.raises(InputError, match=f"methods.kl.{key}"):
        make_config(**GMM, methods={"kl": {key: value}})


def test_gmm_methods_need_the_gmm_dataset(make_config):
    with pytest.raises(InputError, match="data.dataset"):
        prepare_run(make_config(methods={"kl": {}}))


def test_a_client_posterior_with_nan_is_rejected(coordinator):
    coord = coordinator(
        **GMM, methods={"kl": {"n_init": 1}}, federation={"faults": [{"client": 1, "step": "kl.gmm_posterior", "mode": "nan"}]}
    )
    out = coord.run_method("kl")
    assert out["info"]["clients"] == [0, 2, 3, 4]
    assert any(e["kind"] == "update_rejected" and e.get("client") == 1 for e in coord.events.since(0))


@pytest.mark.ray
def test_kl_on_ray_fans_the_solves_out_as_tasks_and_equals_the_in_process_run(ray_session, make_config, tmp_path):
    from actors.backend import RayBackend
    from rayfuse.report import Printer
    from rayfuse.runner import InProcessBackend, run_experiment

    methods = {"kl": {"n_init": 2, "executor": "federation"}, "spahm": {"n_init": 2}}
    quiet = dict(printer=Printer(enabled=False), show_tables=False)
    on_ray = run_experiment(
        make_config(**GMM, methods=methods, federation={"backend": "ray", "clients_per_actor": 5}), RayBackend(), tmp_path / "ray", **quiet
    )
    local = run_experiment(make_config(**GMM, methods=methods), InProcessBackend(), tmp_path / "local", **quiet)
    assert on_ray["status"] == "succeeded" and on_ray["methods"]["kl"]["info"]["executor"] == "federation"
    for label in methods:
        for metric in ("hausdorff", "size_error"):
            assert on_ray["methods"][label][metric] == pytest.approx(local["methods"][label][metric], abs=1e-9), (label, metric)


# -----------------------------------------------------------------------------------------------------------------
# The BNN application (tiny networks, in-process clients)


def test_bnn_neurons_round_trip_and_output_bias_fusion():
    from rayfuse.fusion.kl.bnn import fuse_output_bias, network_of, neurons_of

    rng = np.random.default_rng(9)
    bnn = {
        "w1_mu": rng.normal(size=(4, 3)),
        "w1_var": rng.uniform(0.1, 1, (4, 3)),
        "b1_mu": rng.normal(size=4),
        "b1_var": rng.uniform(0.1, 1, 4),
        "w2_mu": rng.normal(size=(2, 4)),
        "w2_var": rng.uniform(0.1, 1, (2, 4)),
        "b2_mu": rng.normal(size=2),
        "b2_var": rng.uniform(0.1, 1, 2),
    }
    neurons = neurons_of(bnn)
    assert neurons.mean.shape == (4, 3 + 1 + 2)
    back = network_of(neurons, bnn["b2_mu"], bnn["b2_var"], 3)
    for key, value in bnn.items():
        np.testing.assert_allclose(back[key], value)
    mean, var = fuse_output_bias([bnn, bnn])
    np.testing.assert_allclose(mean, bnn["b2_mu"])
    np.testing.assert_allclose(var, bnn["b2_var"])


def test_bnn_job_fuses_the_clients_neurons(coordinator):
    methods = {"kl": {"application": "bnn", "hidden": 8, "bnn_epochs": 2, "mc_samples": 5, "lam": 1.0}}
    coord = coordinator(methods=methods, federation={"faults": [{"client": 2, "step": "kl.bnn_posterior", "mode": "nan"}]})
    out = coord.run_method("kl")
    m = out["metrics"]
    assert np.isfinite(list(m.values())).all()
    assert 0 <= m["accuracy"] <= 1 and m["log_likelihood"] <= 0 and 0 <= m["entropy"] <= np.log(10)
    info = out["info"]
    assert info["clients"] == [0, 1, 3] and info["concatenated_units"] == 24 and 8 <= info["global_units"] <= 24
    assert set(info["local"]) == {"0", "1", "3"}
    assert any(e["kind"] == "update_rejected" and e.get("client") == 2 for e in coord.events.since(0))


def test_topics_job_fuses_dirichlet_topics_above_every_local_model(coordinator):
    from rayfuse.fusion.kl.topics import completion_log_likelihood, split_documents

    data = {
        "dataset": "kl_lda",
        "options": {
            "num_topics": 6,
            "vocabulary": 60,
            "num_groups": 3,
            "docs": 80,
            "test_docs": 40,
            "min_topics": 2,
            "max_topics": 3,
            "doc_length": 60,
            "eta": 0.02,
        },
        "val_size": 0,
    }
    methods = {
        "kl": {"application": "topics", "lam": 1.0, "vi_max_iter": 30},
        "homo": {"method": "kl", "application": "topics", "homogeneous": True, "n_components": 6, "vi_max_iter": 30},
    }
    coord = coordinator(data=data, partition={"method": "labels", "num_clients": 3, "groups": [[0], [1], [2]]}, methods=methods)
    out = {label: coord.run_method(label) for label in methods}
    for entry in out.values():
        m = entry["metrics"]
        assert np.isfinite(list(m.values())).all() and m["completion_ll"] < 0
    assert out["kl"]["metrics"]["completion_ll"] >= out["kl"]["metrics"]["local_completion_ll_max"]
    assert out["kl"]["metrics"]["truth_completion_ll"] == out["homo"]["metrics"]["truth_completion_ll"]  # one split for both
    # folding-in with the true topics beats uniform topics
    rng = np.random.default_rng(0)
    X = rng.multinomial(50, np.full(10, 0.1), size=5)
    seen, held = split_documents(X, rng)
    assert completion_log_likelihood(np.full((2, 10), 0.1), seen, held) == pytest.approx(np.log(0.1), rel=1e-6)


def test_homogeneous_topics_need_a_fixed_count(make_config):
    data = {
        "dataset": "kl_lda",
        "options": {"num_topics": 4, "vocabulary": 30, "num_groups": 2, "docs": 20, "test_docs": 10, "min_topics": 2, "max_topics": 2},
    }
    cfg = make_config(
        data=data,
        partition={"method": "labels", "num_clients": 2, "groups": [[0], [1]]},
        methods={"kl": {"application": "topics", "homogeneous": True}},
    )
    with pytest.raises(InputError, match="methods.kl.n_components"):
        prepare_run(cfg)


def test_the_gmm_methods_tags_are_their_papers():
    """KL-fusion and its baselines fuse posteriors and score against the dataset's true parameters (central only); the
    VI-oracle fits the clients' points pooled."""
    for name in ("kl", "spahm", "dp_cluster"):
        tags = METHODS.get(name).tags
        assert tags.fuses == "posteriors" and not tags.federated_evaluation, name
        assert not (tags.oracle or tags.needs_dataset or tags.multi_round or tags.local_model_only or tags.heterogeneous_clients), name
    oracle = METHODS.get("gmm_oracle").tags
    assert oracle.oracle and oracle.needs_dataset and oracle.fuses == "nothing" and not oracle.federated_evaluation
