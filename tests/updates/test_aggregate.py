"""Aggregation kernels (rayfuse.updates.aggregate): weighted averages checked against np.average, invariants of FedAvg's
aggregation (client order, uniform default, identical models), and the weights it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from rayfuse.updates.aggregate import CHUNK, normalize_weights, weighted_average, weighted_sum

SHAPES = {
    "scalar": (),
    "vector": (7,),
    "matrix": (5, 3),
    "conv": (4, 2, 3, 3),
    "one-chunk": (CHUNK,),
    "chunks-and-a-remainder": (3 * CHUNK + 17,),
    "big-matrix": (300, 250),  # 75 000 elements: three chunks
}


def random_params(num_clients: int, dtype, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{key: rng.normal(size=shape).astype(dtype) for key, shape in SHAPES.items()} for _ in range(num_clients)]


def reference(params, weights):
    return {key: np.average(np.stack([p[key] for p in params]).astype(np.float64), axis=0, weights=weights) for key in params[0]}


def assert_matches(out, expected, params, rtol):
    for key, value in expected.items():
        scale = max(float(np.max(np.abs(p[key]), initial=0.0)) for p in params)
        np.testing.assert_allclose(out[key], value, rtol=rtol, atol=rtol * scale, err_msg=key)


@pytest.mark.parametrize(("dtype", "rtol"), [(np.float32, 1e-6), (np.float64, 1e-13)])
@pytest.mark.parametrize("num_clients", [1, 2, 5])
def test_weighted_average_equals_np_average(dtype, rtol, num_clients):
    params = random_params(num_clients, dtype)
    weights = np.random.default_rng(1).uniform(0.1, 10.0, size=num_clients).tolist()
    out = weighted_average(params, weights)
    assert set(out) == set(SHAPES)
    for key, shape in SHAPES.items():
        assert out[key].shape == shape and out[key].dtype == dtype, key
    assert_matches(out, reference(params, weights), params, rtol)


@pytest.mark.parametrize("chunk", [1, 7, 64, CHUNK])
def test_chunk_size_does_not_change_the_result(chunk):
    rng = np.random.default_rng(2)
    arrays = [rng.normal(size=(301,)) for _ in range(3)]
    weights = [0.2, 0.3, 0.5]
    expected = 0.2 * arrays[0] + 0.3 * arrays[1] + 0.5 * arrays[2]
    np.testing.assert_allclose(weighted_sum(arrays, weights, chunk=chunk), expected, rtol=1e-14)


def test_weighted_average_by_hand():
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array(0.0, np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32), "b": np.array(4.0, np.float32)}
    out = weighted_average([a, b], [1, 3])  # weights 1/4, 3/4
    assert out["w"].tolist() == [2.5, 5.0] and float(out["b"]) == 3.0
    assert out["b"].shape == ()


@pytest.mark.parametrize("seed", range(3))
def test_result_does_not_depend_on_client_order(seed):
    params = random_params(5, np.float32, seed=seed)
    weights = [3.0, 1.0, 7.0, 2.0, 5.0]
    order = np.random.default_rng(seed).permutation(5)
    out = weighted_average(params, weights)
    permuted = weighted_average([params[i] for i in order], [weights[i] for i in order])
    for key in out:
        np.testing.assert_allclose(permuted[key], out[key], rtol=1e-6, atol=1e-6, err_msg=key)


def test_none_weights_are_uniform():
    params = random_params(4, np.float64)
    uniform = weighted_average(params)
    explicit = weighted_average(params, [2.5] * 4)
    for key in uniform:
        np.testing.assert_allclose(uniform[key], np.mean([p[key] for p in params], axis=0), rtol=1e-13, atol=1e-15)
        np.testing.assert_array_equal(uniform[key], explicit[key])


def test_weights_are_scale_free():
    params = random_params(3, np.float64)
    a, b = weighted_average(params, [1, 2, 3]), weighted_average(params, [100, 200, 300])
    assert all(np.allclose(a[k], b[k], rtol=1e-14, atol=0) for k in a)


def test_averaging_identical_models_returns_the_model():
    model = random_params(1, np.float32)[0]
    out = weighted_average([model, model, model], [5, 1, 2])
    for key in model:
        np.testing.assert_allclose(out[key], model[key], rtol=1e-6, atol=0)


def test_single_client_with_one_weight_is_copied_exactly():
    model = random_params(1, np.float32)[0]
    out = weighted_average([model], [42])
    for key in model:
        np.testing.assert_array_equal(out[key], model[key])
        assert not np.shares_memory(out[key], model[key])


def test_zero_weight_client_is_ignored():
    params = random_params(3, np.float64)
    params[1] = {k: np.full_like(v, 1e6) for k, v in params[1].items()}
    with_zero = weighted_average(params, [1, 0, 1])
    without = weighted_average([params[0], params[2]], [1, 1])
    for key in with_zero:
        np.testing.assert_allclose(with_zero[key], without[key], rtol=1e-14, atol=1e-15)


def test_integer_buffers_are_averaged_then_rounded_to_their_dtype():
    params = [
        {"count": np.array(10, np.int64), "ids": np.array([1, 2, 3], np.int32)},
        {"count": np.array(13, np.int64), "ids": np.array([2, 2, 8], np.int32)},
    ]
    out = weighted_average(params, [1, 1])
    assert out["count"].dtype == np.int64 and out["count"].shape == ()
    assert int(out["count"]) == 12  # 11.5 rounds half to even
    assert out["ids"].dtype == np.int32 and out["ids"].tolist() == [2, 2, 6]  # 1.5 -> 2, 2, 5.5 -> 6
    weighted = weighted_average(params, [3, 1])  # 0.75 * 10 + 0.25 * 13 = 10.75
    assert int(weighted["count"]) == 11


def test_inputs_are_never_modified():
    params = random_params(3, np.float32)
    before = [{k: v.copy() for k, v in p.items()} for p in params]
    weights = [1.0, 2.0, 3.0]
    out = weighted_average(params, weights)
    for p, b in zip(params, before):
        for key in p:
            np.testing.assert_array_equal(p[key], b[key])
            assert not np.shares_memory(out[key], p[key])
    assert weights == [1.0, 2.0, 3.0]


def test_read_only_inputs_are_fine():
    params = random_params(3, np.float32)
    for p in params:
        for value in p.values():
            value.setflags(write=False)  # as Ray hands them out of the object store
    out = weighted_average(params, [1, 1, 2])
    assert_matches(out, reference(params, [1, 1, 2]), params, 1e-6)
    assert all(v.flags.writeable for v in out.values())


def test_non_contiguous_inputs_are_averaged_correctly():
    rng = np.random.default_rng(3)
    base = [rng.normal(size=(40, 30)) for _ in range(2)]
    params = [{"w": b.T} for b in base]  # Fortran-ordered views
    out = weighted_average(params, [1, 3])
    # BLAS axpy fuses the multiply-add, so the last bit may differ from numpy's two-step expression
    np.testing.assert_allclose(out["w"], 0.25 * base[0].T + 0.75 * base[1].T, rtol=1e-12, atol=1e-15)


def test_weighted_sum_writes_into_out():
    arrays = [np.ones(5), np.full(5, 3.0)]
    out = np.empty(5)
    result = weighted_sum(arrays, [0.5, 0.5], out=out)
    assert result is out and out.tolist() == [2.0] * 5


@pytest.mark.parametrize("out", [np.empty((3, 2), order="F"), np.empty(6), np.empty((3, 4))[:, ::2]], ids=["fortran", "flat", "strided"])
def test_weighted_sum_refuses_an_out_it_cannot_write_through(out):
    # A non-C-contiguous out used to be reshaped into a copy: the sum was lost and garbage returned.
    arrays = [np.ones((3, 2)), np.ones((3, 2))]
    with pytest.raises(ValueError, match="out must be a C-contiguous array of shape"):
        weighted_sum(arrays, [0.5, 0.5], out=out)


# ---------------------------------------------------------------------------------------------------------------
# Weights


def test_normalize_weights_by_hand():
    assert normalize_weights([1, 3], 2) == [0.25, 0.75]
    assert normalize_weights(None, 4) == [0.25] * 4
    assert all(type(w) is float for w in normalize_weights(np.array([2, 2], np.int64), 2))


@pytest.mark.parametrize(
    ("weights", "n", "match"),
    [
        pytest.param([1.0, -0.5], 2, "non-negative", id="negative"),
        pytest.param([1.0, float("nan")], 2, "finite", id="nan"),
        pytest.param([1.0, float("inf")], 2, "finite", id="inf"),
        pytest.param([0.0, 0.0], 2, "not all zero", id="all-zero"),
        pytest.param([1.0, 2.0, 3.0], 2, r"need 2 weights, got shape \(3,\)", id="too-many"),
        pytest.param([1.0], 2, r"need 2 weights", id="too-few"),
        pytest.param([[1.0, 2.0]], 2, r"need 2 weights", id="nested"),
        pytest.param(None, 0, "nothing to aggregate", id="no-clients"),
    ],
)
def test_bad_weights_raise_value_error(weights, n, match):
    with pytest.raises(ValueError, match=match):
        normalize_weights(weights, n)


@pytest.mark.parametrize("weights", [[1.0, -1.0], [float("nan"), 1.0], [0, 0], [1.0]])
def test_weighted_average_rejects_bad_weights(weights):
    with pytest.raises(ValueError):
        weighted_average(random_params(2, np.float32), weights)


def test_weighted_average_of_nothing_raises():
    with pytest.raises(ValueError, match="nothing to aggregate"):
        weighted_average([])
