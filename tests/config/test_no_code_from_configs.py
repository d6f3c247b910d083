"""Issue 31, class 3 (no code runs from a config beyond importing the module it names) and the first half of class 5
(readers catch by what can fail, sizes bounded before allocation, a model check that accepts what models do).

Every case of :data:`CASES` is refused with exit code 2 (:class:`InputError` from the Python API), one line naming the
key path or file, no traceback, and nothing written in the case's folder. A class 3 case also names a file that the
code it must not run would create (``ran``: a shell command, a copy, a write); the file must not exist afterwards.
:data:`VALID` holds valid but unusual inputs that must keep working.

The cases run in-process (``rayfuse.cli.main``, the Python API or a reader function), with the case's folder as the
working directory; user modules written there are imported under a name of their own, and removed from
``sys.modules`` after the case.
"""

from __future__ import annotations

import io
import json
import sys
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rayfuse
import rayfuse.api
from rayfuse.cli import main
from tests.config.test_bad_inputs import Files, _snapshot, call, isolated, refused_line  # noqa: F401  (isolated: a fixture)

SENTINEL = "ran"  # what a command or function that must not run would create

# A user module whose every builder would leave the sentinel behind, and a model class that is fine to build.
NET = '''
import torch
from torch import nn


class Net(nn.Linear):
    """The test checkpoints' architecture (weight 4 x 3, bias 4)."""

    def __init__(self, in_features=3, out_features=4):
        super().__init__(in_features, out_features)

    @classmethod
    def small(cls):
        return cls()

    @staticmethod
    def build():
        return Net()
'''

RUNS = """
def _ran(*args, **kwargs):
    open("ran", "w").write("code ran")
"""


@dataclass(frozen=True)
class Case:
    """A bad input: ``make(files)`` returns the command line (a list) or a callable; ``names`` is what the one line must
    name; ``sentinel``: a file that must not exist afterwards (class 3: no code ran)."""

    id: str
    make: Callable[[Files], Any]
    names: str
    cls: int
    sentinel: str | None = None


CASES: list[Case] = []


def case(cls: int, id: str, names: str, sentinel: str | None = None) -> Callable[[Callable[[Files], Any]], Callable[[Files], Any]]:
    def add(make: Callable[[Files], Any]) -> Callable[[Files], Any]:
        CASES.append(Case(id, make, names, cls, sentinel))
        return make

    return add


def module(f: Files, name: str, body: str) -> str:
    """Write the user module ``name`` into the case's folder (the working directory, which rayfuse imports from)."""
    f.text(f"{name}.py", body)
    return name


def fuse_arch(f: Files, architecture: str, args: dict[str, Any] | None = None, **fields: Any) -> list[str]:
    """``rayfuse fuse`` of the two (4 x 3 Linear) test models with ``architecture`` (built, its checkpoints checked
    against it and one input of 3 features run through it), averaged."""
    config: dict[str, Any] = {"merge_method": "average", "architecture": architecture, "input_shape": [3], **fields}
    if args is not None:
        config["architecture_args"] = args
    return ["fuse", f.fuse(**config)]


def fuse_api(f: Files, architecture: str, args: dict[str, Any] | None = None) -> Callable[[], Any]:
    config = {
        "merge_method": "weight_matching",
        "architecture": architecture,
        "input_shape": [3],
        "models": [{"model": m} for m in f.models()],
        "output": "fused.safetensors",
    }
    if args is not None:
        config["architecture_args"] = args
    return call(rayfuse.fuse, config)


# ---------------------------------------------------------------------------------------------------------------
# 3. No code runs from a config beyond importing the module it names

SHELL = {"command": f"touch {SENTINEL}"}
case(3, "fuse-os-system", "architecture", SENTINEL)(lambda f: fuse_arch(f, "os:system", SHELL))
case(3, "fuse-os-popen", "architecture", SENTINEL)(lambda f: fuse_arch(f, "os:popen", {"cmd": f"touch {SENTINEL}"}))
case(3, "fuse-subprocess-run", "architecture", SENTINEL)(lambda f: fuse_arch(f, "subprocess:run", {"args": ["touch", SENTINEL]}))
case(3, "fuse-subprocess-popen-class", "architecture", SENTINEL)(lambda f: fuse_arch(f, "subprocess:Popen", {"args": ["touch", SENTINEL]}))
case(3, "fuse-builtins-exec", "architecture", SENTINEL)(lambda f: fuse_arch(f, "builtins:exec", {"source": f"open({SENTINEL!r}, 'w')"}))
case(3, "fuse-shutil-copy", "architecture", SENTINEL)(lambda f: fuse_arch(f, "shutil:copy", {"src": "fuse.yaml", "dst": SENTINEL}))
case(3, "fuse-pathlib-class", "architecture", SENTINEL)(lambda f: fuse_arch(f, "pathlib:Path", {}))
case(3, "fuse-numpy-save", "architecture", SENTINEL)(lambda f: fuse_arch(f, "numpy:save", {"file": SENTINEL, "arr": [1]}))
case(3, "fuse-rayfuse-write", "architecture", SENTINEL)(
    lambda f: fuse_arch(f, "rayfuse.io:atomic_write_text", {"path": SENTINEL, "text": "x"})
)
case(3, "fuse-torchvision-function", "torchvision:resnet18")(lambda f: fuse_arch(f, "torchvision.models.resnet:resnet18", {}))
case(3, "fuse-reexported-builtin", "architecture", SENTINEL)(
    lambda f: fuse_arch(f, module(f, "m_reexport_builtin", "from os import system as build\n") + ":build", SHELL)
)
case(3, "fuse-reexported-function", "defined in shutil", SENTINEL)(
    lambda f: fuse_arch(
        f, module(f, "m_reexport_function", "from shutil import copy as build\n") + ":build", {"src": "fuse.yaml", "dst": SENTINEL}
    )
)
case(3, "fuse-class-not-a-module", "not an nn.Module", SENTINEL)(
    lambda f: fuse_arch(f, module(f, "m_plain_class", RUNS + "class Builder:\n    __init__ = _ran\n") + ":Builder", {})
)
case(3, "fuse-callable-instance", "architecture", SENTINEL)(
    lambda f: fuse_arch(f, module(f, "m_instance", RUNS + "class B:\n    __call__ = _ran\nbuild = B()\n") + ":build", {})
)
case(3, "fuse-partial", "architecture", SENTINEL)(
    lambda f: fuse_arch(f, module(f, "m_partial", RUNS + "import functools\nbuild = functools.partial(_ran, 1)\n") + ":build", {})
)
case(3, "fuse-instance-method", "instance method")(lambda f: fuse_arch(f, module(f, "m_method", NET) + ":Net.forward", {}))
case(3, "fuse-classmethod-of-a-plain-class", "architecture", SENTINEL)(
    lambda f: fuse_arch(f, module(f, "m_plain_classmethod", RUNS + "class Maker:\n    make = classmethod(_ran)\n") + ":Maker.make", {})
)
case(3, "fuse-property-not-run", "architecture", SENTINEL)(
    lambda f: fuse_arch(f, module(f, "m_property", RUNS + "class Holder:\n    model = property(_ran)\n") + ":Holder.model", {})
)
case(3, "fuse-module-value", "architecture")(lambda f: fuse_arch(f, module(f, "m_value", "WIDTH = 3\n") + ":WIDTH", {}))
case(3, "fuse-module-exits-at-import", "the module exited at import")(
    lambda f: fuse_arch(
        f,
        module(
            f,
            "m_argparse",
            "import argparse\nparser = argparse.ArgumentParser()\n"
            "parser.add_argument('--width', required=True)\nargs = parser.parse_args()\n",
        )
        + ":Net",
    )
)
case(3, "fuse-module-sys-exit-0", "the module exited at import")(
    lambda f: fuse_arch(f, module(f, "m_exit0", "import sys\nprint('bye')\nsys.exit(0)\n") + ":Net")
)
case(3, "fuse-module-raises-at-import", "the module raised at import: ValueError: no GPU here")(
    lambda f: fuse_arch(f, module(f, "m_raises", "raise ValueError('no GPU here\\nsecond line')\n") + ":Net")
)
case(3, "fuse-module-missing-dependency", "ModuleNotFoundError")(
    lambda f: fuse_arch(f, module(f, "m_missing_dep", "import no_such_dependency_31\n") + ":Net")
)
case(3, "fuse-module-syntax-error", "the module raised at import: SyntaxError")(
    lambda f: fuse_arch(f, module(f, "m_syntax", "def broken(:\n") + ":Net")
)
case(3, "fuse-constructor-exits", "exited")(
    lambda f: fuse_arch(
        f,
        module(
            f,
            "m_ctor_exit",
            "import sys\nfrom torch import nn\n\nclass Net(nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        sys.exit(3)\n",
        )
        + ":Net",
        {},
    )
)
case(3, "fuse-teacher-architecture-os-system", "models.1.architecture", SENTINEL)(
    lambda f: [
        "fuse",
        f.yaml(
            "fuse.yaml",
            {
                "merge_method": "distill",
                "architecture": "torch.nn:Linear",
                "architecture_args": {"in_features": 3, "out_features": 4},
                "input_shape": [3],
                "models": [{"model": f.models()[0]}, {"model": "m1.safetensors", "architecture": "os:system", "architecture_args": SHELL}],
                "output": "fused.safetensors",
            },
        ),
    ]
)
case(3, "symmetry-os-system", "architecture", SENTINEL)(lambda f: ["symmetry", "os:system", "--args", json.dumps(SHELL)])
case(3, "symmetry-module-exits-at-import", "the module exited at import")(
    lambda f: ["symmetry", module(f, "m_sym_argparse", "import argparse\nargparse.ArgumentParser().parse_args(['--x'])\n") + ":Net"]
)
case(3, "api-fuse-os-system", "architecture", SENTINEL)(lambda f: fuse_api(f, "os:system", SHELL))
case(3, "api-fuse-subprocess-check-call", "architecture", SENTINEL)(
    lambda f: fuse_api(f, "subprocess:check_call", {"args": ["touch", SENTINEL]})
)
case(3, "api-symmetry-subprocess-run", "architecture", SENTINEL)(
    lambda f: call(rayfuse.api.symmetry, "subprocess:run", input_shape=[3], args={"args": ["touch", SENTINEL]})
)


# ---------------------------------------------------------------------------------------------------------------
# 5. Model checks: a forward that raises, outputs that are not logits


def model_module(f: Files, name: str, forward: str) -> str:
    """A module whose ``Net`` holds the test checkpoints' tensors (a 3 -> 4 Linear, ``self.fc(x)``) and runs ``forward``."""
    return (
        module(
            f,
            name,
            "import torch\nfrom torch import nn\n\n\nclass Net(nn.Linear):\n    def __init__(self):\n"
            "        super().__init__(3, 4)\n\n    def fc(self, x):\n        return super().forward(x)\n\n"
            "    def forward(self, x):\n" + "".join(f"        {line}\n" for line in forward.splitlines()),
        )
        + ":Net"
    )


def fuse_model(f: Files, name: str, forward: str, **fields: Any) -> list[str]:
    return ["fuse", f.fuse(merge_method="average", architecture=model_module(f, name, forward), **({"input_shape": [3]} | fields))]


case(5, "fuse-forward-raises", "the model's forward raised ValueError: expected a mask")(
    lambda f: fuse_model(f, "m_fwd_raises", "raise ValueError('expected a mask\\nmore')")
)
case(5, "fuse-forward-raises-on-data", "data.path")(
    lambda f: fuse_model(
        f,
        "m_fwd_raises_data",
        "raise RuntimeError('shape mismatch')",
        input_shape=None,
        data={"path": f.npz(X=np.ones((60, 3), np.float32))},
    )
)
case(5, "fuse-forward-returns-none-first", "input_shape: expected the model returning (batch, classes) logits")(
    lambda f: fuse_model(f, "m_fwd_none_first", "return None, self.fc(x)")
)
case(5, "fuse-forward-returns-dict-without-logits", "input_shape")(lambda f: fuse_model(f, "m_fwd_dict", "return {'scores': self.fc(x)}"))
case(5, "fuse-forward-returns-3d", "input_shape")(lambda f: fuse_model(f, "m_fwd_3d", "return self.fc(x)[:, None, :]"))
case(5, "fuse-forward-returns-text", "input_shape")(lambda f: fuse_model(f, "m_fwd_text", "return 'logits'"))


# ---------------------------------------------------------------------------------------------------------------
# 5. Readers: npz archives, bounded before anything is allocated


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def npy_header(shape: tuple[int, ...], descr: str = "<f8", version: tuple[int, int] = (1, 0)) -> bytes:
    buffer = io.BytesIO()
    write = np.lib.format.write_array_header_1_0 if version == (1, 0) else np.lib.format.write_array_header_2_0
    write(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


LABELS = np.arange(60) % 3


def zip_npz(f: Files, members: dict[str, bytes], name: str = "data.npz", compress: bool = False) -> str:
    with zipfile.ZipFile(f.root / name, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return name


def _truncated(f: Files, keep: float) -> str:
    name = f.npz()
    data = (f.root / name).read_bytes()
    return f.raw(name, data[: int(len(data) * keep)])


def _corrupt_compressed(f: Files) -> str:
    X = np.random.default_rng(0).normal(size=(60, 4))
    name = zip_npz(f, {"X.npy": npy_bytes(X), "y.npy": npy_bytes(LABELS)}, compress=True)
    data = bytearray((f.root / name).read_bytes())
    data[60:140] = bytes(80)  # inside X.npy's deflate stream
    return f.raw(name, bytes(data))


def _huge_declared(f: Files) -> str:
    """X.npy's header declares 10^6 x 10^6 float64 (7.3 TiB); the member holds 64 bytes."""
    return zip_npz(f, {"X.npy": npy_header((10**6, 10**6)) + bytes(64), "y.npy": npy_bytes(LABELS)})


def _consistent(count: int) -> Callable[[Files], str]:
    """X.npy declares ``count`` float64 and the zip directory agrees (its uncompressed size patched to match): only
    the memory bound can refuse it, from the header, before numpy allocates."""

    def write(f: Files) -> str:
        header = npy_header((count,))
        with zipfile.ZipFile(f.root / "data.npz", "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("X.npy", header + bytes(4096))
            archive.writestr("y.npy", npy_bytes(LABELS))
            archive.filelist[0].file_size = len(header) + count * 8  # written to the central directory (zip64) at close
        return "data.npz"

    return write


_huge_consistent = _consistent(10**14)  # 800 TB: above the memory of any machine the tests run on


def _object_header(f: Files) -> str:
    return zip_npz(f, {"X.npy": npy_header((60, 4), "|O") + bytes(480), "y.npy": npy_bytes(LABELS)})


def _bad_magic(f: Files) -> str:
    return zip_npz(f, {"X.npy": b"not an npy array at all", "y.npy": npy_bytes(LABELS)})


def _bad_header_text(f: Files) -> str:
    header = npy_header((60, 4))
    broken = header.replace(b"'shape': (60, 4)", b"'shape': (60, 4 ")  # an unclosed tuple: the header parser's own error
    return zip_npz(f, {"X.npy": broken + bytes(1920), "y.npy": npy_bytes(LABELS)})


def _format_3(f: Files) -> str:
    magic = npy_header((60, 4))
    return zip_npz(f, {"X.npy": b"\x93NUMPY\x03\x00" + magic[8:] + bytes(1920), "y.npy": npy_bytes(LABELS)})


NPZ_FILES: dict[str, tuple[Callable[[Files], str], str]] = {
    "truncated-half": (lambda f: _truncated(f, 0.5), "data.npz"),
    "truncated-end": (lambda f: _truncated(f, 0.97), "data.npz"),
    "corrupt-deflate-stream": (_corrupt_compressed, "data.npz"),
    "zip-not-npz": (lambda f: zip_npz(f, {"readme.txt": b"hello", "X": b"abc"}), "data.npz"),
    "member-not-npy": (_bad_magic, "data.npz"),
    "header-declares-7-tib": (_huge_declared, "data.npz: X"),
    "header-declares-800-tb-consistently": (_huge_consistent, "data.npz: expected arrays that fit in memory"),
    "object-array-header": (_object_header, "data.npz: X"),
    "header-syntax-error": (_bad_header_text, "data.npz"),
    "npy-format-3": (_format_3, "data.npz: X"),
    "header-declares-more-than-held": (
        lambda f: zip_npz(f, {"X.npy": npy_header((60, 4)) + bytes(100), "y.npy": npy_bytes(LABELS)}),
        "data.npz: X",
    ),
}

for _name, (_write, _names) in NPZ_FILES.items():
    case(5, f"validate-npz-{_name}", _names)(lambda f, w=_write: ["validate", f.job(data={"dataset": "npz", "path": w(f)})])
for _name in ("truncated-half", "header-declares-800-tb-consistently", "corrupt-deflate-stream"):
    _write, _names = NPZ_FILES[_name]
    case(5, f"run-npz-{_name}", _names)(lambda f, w=_write: ["run", f.job(data={"dataset": "npz", "path": w(f)})])
    case(5, f"fuse-data-npz-{_name}", _names)(
        lambda f, w=_write: [
            "fuse",
            f.fuse(
                merge_method="activation_matching",
                architecture="torch.nn:Linear",
                architecture_args={"in_features": 3, "out_features": 4},
                data={"path": w(f)},
            ),
        ]
    )


def _memory_bound(available: int) -> Callable[[Files, pytest.MonkeyPatch], None]:
    """The memory available, as the bounds read it, set to ``available`` bytes: an ordinary small file then exceeds it."""

    def patch(f: Files, monkeypatch: pytest.MonkeyPatch) -> None:
        import rayfuse.models.registry

        monkeypatch.setattr(rayfuse.models.registry, "available_memory", lambda: available)

    return patch


@dataclass(frozen=True)
class Patched:
    """A case that needs a monkeypatch before it runs: ``patch(files, monkeypatch)``, then ``make(files)``."""

    patch: Callable[[Files, pytest.MonkeyPatch], None]
    make: Callable[[Files], Any]

    def __call__(self, f: Files) -> Any:
        return self


case(5, "validate-npz-header-declares-200-gb-on-a-64-gib-machine", "data.npz: expected arrays that fit in memory")(
    Patched(_memory_bound(64 * 2**30), lambda f: ["validate", f.job(data={"dataset": "npz", "path": _consistent(25 * 10**9)(f)})])
)
case(5, "validate-npz-above-the-memory-available", "data.npz: expected arrays that fit in memory")(
    Patched(
        _memory_bound(64 * 2**10),
        lambda f: ["validate", f.job(data={"dataset": "npz", "path": f.npz(X=np.zeros((6000, 4)), y=np.arange(6000) % 3)})],
    )
)


# ---------------------------------------------------------------------------------------------------------------
# 5. Readers: tables (parquet, csv)


def _parquet_table(f: Files, name: str = "data.parquet", **columns: Any) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = {"a": pa.array(np.random.default_rng(0).normal(size=60)), "y": pa.array(np.arange(60) % 3)}
    base.update(columns)
    pq.write_table(pa.Table.from_arrays(list(base.values()), names=list(base)), f.root / name)
    return name


def _parquet_duplicates(f: Files) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = pa.array(np.arange(60, dtype=np.float64))
    pq.write_table(pa.Table.from_arrays([a, a, pa.array(np.arange(60) % 3)], names=["a", "a", "y"]), f.root / "data.parquet")
    return "data.parquet"


def _nested_labels() -> Any:
    import pyarrow as pa

    return pa.array([[i % 3, 1] for i in range(60)])


def _struct_labels() -> Any:
    import pyarrow as pa

    return pa.array([{"code": i % 3} for i in range(60)])


def _timestamps() -> Any:
    import pyarrow as pa

    return pa.array(np.arange(60).astype("datetime64[s]"))


def _lists() -> Any:
    import pyarrow as pa

    return pa.array([[float(i)] for i in range(60)])


TABLES: dict[str, tuple[Callable[[Files], str], Any, str]] = {
    # name: (writes data.parquet, data.features, what the line names)
    "duplicate-columns": (_parquet_duplicates, None, "data.parquet: expected columns with distinct names"),
    "nested-list-labels": (lambda f: _parquet_table(f, y=_nested_labels()), None, "data.label"),
    "struct-labels": (lambda f: _parquet_table(f, y=_struct_labels()), None, "data.label"),
    "timestamp-labels": (lambda f: _parquet_table(f, y=_timestamps()), None, "data.label"),
    "timestamp-feature-named": (lambda f: _parquet_table(f, t=_timestamps()), ["a", "t"], "data.features"),
    "list-feature-named": (lambda f: _parquet_table(f, v=_lists()), ["v"], "data.features"),
}
for _name, (_write, _features, _names) in TABLES.items():
    case(5, f"validate-parquet-{_name}", _names)(
        lambda f, w=_write, c=_features: ["validate", f.job(data={"dataset": "parquet", "path": w(f), **({"features": c} if c else {})})]
    )
case(5, "run-parquet-nested-labels", "data.label")(
    lambda f: ["run", f.job(data={"dataset": "parquet", "path": TABLES["nested-list-labels"][0](f)})]
)


def _read(kind: str, **kwargs: Any) -> Callable[[Files], Callable[[], Any]]:
    from rayfuse.data.datasets import read_data_file

    return lambda f: call(read_data_file, f.text("data.csv", "a,a,y\n1,2,0\n3,4,1\n5,6,2\n"), kind=kind, **kwargs)


case(5, "read-csv-duplicate-columns", "data.csv: expected columns with distinct names")(_read("csv"))
case(5, "read-csv-duplicate-columns-features-named", "data.csv")(_read("csv", features=["a"]))
case(5, "read-unlabeled-csv-duplicate-columns", "data.csv")(
    lambda f: call(
        __import__("rayfuse.data.datasets", fromlist=["x"]).read_unlabeled_file,
        f.text("data.csv", "a,a\n1,2\n3,4\n"),
        kind="csv",
        features=["a"],
    )
)


# ---------------------------------------------------------------------------------------------------------------
# 5. Readers: silo image folders (decompression bombs, damaged images, sizes)


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` (grey, 8 bit) and holds one empty image row: PIL reads the size from
    its header; decoding it would allocate width x height bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(width + 1))) + chunk(b"IEND", b"")


def image_folder(f: Files, odd: tuple[str, bytes] | None = None, size: tuple[int, int] = (6, 5), per_class: int = 3) -> str:
    """``images/{a,b}/`` with small PNGs, and the file ``odd`` (name, bytes) in ``a``."""
    from PIL import Image

    for c, cls in enumerate(("a", "b")):
        folder = f.root / "images" / cls
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(np.full((size[1], size[0], 3), 40 * c + 10 * i, np.uint8)).save(folder / f"img{i}.png")
    if odd is not None:
        f.raw(f"images/a/{odd[0]}", odd[1])
    return "images"


def silo_job(f: Files, silo: dict[str, Any]) -> str:
    """A silo job: client 0 an npz file, client 1 ``silo``; in-process, run folder under ./runs."""
    X = np.random.default_rng(0).normal(size=(40, 3 * 5 * 6)).astype(np.float32).reshape(40, 3, 5, 6)
    np.savez(f.root / "site0.npz", X=X, y=np.arange(40) % 2)
    return f.yaml(
        "job.yaml",
        {
            "run": {"name": "silo", "seed": 0, "storage": "runs"},
            "data": {"silos": [{"dataset": "npz", "path": "site0.npz"}, silo]},
            "model": {"name": "mlp", "hidden": [8]},
            "train": {"epochs": 1},
            "federation": {"backend": "local"},
            "methods": {"average": {}},
        },
    )


def load_image_silo(f: Files, odd: tuple[str, bytes] | None = None, **spec: Any) -> Callable[[], Any]:
    from rayfuse.data.silos import load_silo

    return call(load_silo, {"dataset": "imagefolder", "path": image_folder(f, odd), "val_size": 0.34, **spec}, client=1)


BOMB = ("bomb.png", png_header(100_000, 100_000))  # 10^10 pixels: above twice PIL's bound
case(5, "silo-image-decompression-bomb-error", "data.silos.1.path: expected readable images")(lambda f: load_image_silo(f, BOMB))
case(5, "silo-image-decompression-bomb-warning", "DecompressionBombWarning")(
    lambda f: load_image_silo(f, ("large.png", png_header(10_000, 10_000)))
)  # 10^8 pixels: above the bound, below twice
case(5, "silo-image-truncated", "img-cut.png")(lambda f: load_image_silo(f, ("img-cut.png", png_header(6, 5)[:30])))
case(5, "silo-image-not-an-image", "notes.png")(lambda f: load_image_silo(f, ("notes.png", b"these are notes, not pixels")))
case(5, "silo-image-bad-chunk-crc", "broken.png")(
    lambda f: load_image_silo(f, ("broken.png", png_header(6, 5)[:29] + b"\x00\x00\x00\x00" + png_header(6, 5)[33:]))
)


def _decoder_raises(error: BaseException) -> Callable[[Files, pytest.MonkeyPatch], None]:
    """PIL's decoding of a damaged file raising ``error`` (EOFError, SyntaxError and struct.error come out of PIL's
    plugins on some truncated files): the reader catches what decoding can raise, not a fixed list."""

    def patch(f: Files, monkeypatch: pytest.MonkeyPatch) -> None:
        import rayfuse.data.silos

        def broken(image: Any, **kwargs: Any) -> Any:
            raise error

        monkeypatch.setattr(rayfuse.data.silos, "_image_pixels", broken)

    return patch


for _error in (
    EOFError("no more data"),
    SyntaxError("not a PNG file"),
    __import__("struct").error("unpack requires 4 bytes"),
    RuntimeError("decoder failed"),
):
    case(5, f"silo-image-decoder-raises-{type(_error).__name__}", f"{type(_error).__name__}: ")(
        Patched(_decoder_raises(_error), lambda f: load_image_silo(f))
    )


def _csv_parser_raises(error: BaseException) -> Callable[[Files, pytest.MonkeyPatch], None]:
    def patch(f: Files, monkeypatch: pytest.MonkeyPatch) -> None:
        import pyarrow.csv

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise error

        monkeypatch.setattr(pyarrow.csv, "read_csv", broken)

    return patch


for _error in (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), MemoryError("csv block")):
    case(5, f"read-csv-parser-raises-{type(_error).__name__}", f"{type(_error).__name__}: ")(
        Patched(
            _csv_parser_raises(_error),
            lambda f: call(
                __import__("rayfuse.data.datasets", fromlist=["read_data_file"]).read_data_file,
                f.text("data.csv", "a,b,y\n1,2,0\n3,4,1\n"),
                kind="csv",
            ),
        )
    )


case(5, "silo-images-above-the-memory-available", "data.silos.1.image_size: expected images that fit")(
    Patched(_memory_bound(64 * 2**10), lambda f: load_image_silo(f, image_size=[64, 64]))
)
case(5, "silo-images-own-size-above-the-memory-available", "data.silos.1.path: expected images that fit")(
    Patched(_memory_bound(2**10), lambda f: load_image_silo(f, None))
)
case(5, "run-silo-image-bomb", "data.silos.1.path")(
    lambda f: ["run", silo_job(f, {"dataset": "imagefolder", "path": image_folder(f, BOMB), "image_size": [5, 6]})]
)
case(5, "validate-silo-image-size-40000-squared", "data.silos.1.image_size")(
    lambda f: ["validate", silo_job(f, {"dataset": "imagefolder", "path": "images", "image_size": [40000, 40000]})]
)
case(5, "validate-target-resize-40000-squared", "data.target.resize")(
    lambda f: ["validate", f.job(data={"dataset": "digits", "target": {"dataset": "digits", "resize": [40000, 40000]}})]
)
case(5, "validate-silo-image-size-one-side-huge", "data.silos.1.image_size")(
    lambda f: ["validate", silo_job(f, {"dataset": "imagefolder", "path": "images", "image_size": [1, 100_000_000]})]
)


# ---------------------------------------------------------------------------------------------------------------
# 5. Readers: permutation spec files and hand-written specs


def fuse_spec(f: Files, spec_bytes: bytes) -> list[str]:
    f.raw("spec.json", spec_bytes)
    return [
        "fuse",
        f.fuse(
            merge_method="weight_matching",
            architecture="torch.nn:Linear",
            architecture_args={"in_features": 3, "out_features": 4},
            input_shape=[3],
            parameters={"spec": "spec.json"},
        ),
    ]


def _group(**changes: Any) -> bytes:
    group = {"name": "P0", "size": 4, "axes": [{"key": "weight", "dim": 0}, {"key": "bias", "dim": 0}], **changes}
    return json.dumps({"groups": [group]}).encode()


SPECS: dict[str, tuple[bytes, str]] = {
    "latin1": ('{"groups": [], "notes": ["caf\xe9"]}'.encode("latin-1"), "spec.json: expected UTF-8 text"),
    "utf16": ('{"groups": []}'.encode("utf-16"), "spec.json: expected UTF-8 text"),
    "deeply-nested": (b'{"groups": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "spec.json: expected a JSON permutation spec nested"),
    "not-json": (b"groups: [p0]\n", "spec.json: expected a JSON permutation spec"),
    "size-as-text": (_group(size="4"), "parameters.spec.groups.0.size"),
    "size-boolean": (_group(size=True), "parameters.spec.groups.0.size"),
    "size-zero": (_group(size=0), "parameters.spec.groups.0.size"),
    "group-a-list": (json.dumps({"groups": [["P0", 4]]}).encode(), "parameters.spec.groups.0"),
    "axis-dim-float": (_group(axes=[{"key": "weight", "dim": 0.5}]), "parameters.spec.groups.0.axes.0.dim"),
    "axis-negative-outer": (_group(axes=[{"key": "weight", "dim": 0, "outer": -1}]), "parameters.spec.groups.0.axes.0.outer"),
    "axes-empty": (_group(axes=[]), "parameters.spec.groups.0.axes"),
    "name-nested-deep": (json.dumps({"groups": [{"name": [[[["x"]]]], "size": 4, "axes": []}]}).encode(), "parameters.spec.groups.0.name"),
    "fixed-not-a-list": (json.dumps({"groups": [], "fixed": "weight"}).encode(), "parameters.spec.fixed"),
    "probe-without-node": (_group(probes=[{"dim": 1}]), "parameters.spec.groups.0.probes.0"),
}
for _name, (_bytes, _names) in SPECS.items():
    case(5, f"fuse-spec-{_name}", _names)(lambda f, b=_bytes: fuse_spec(f, b))


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


case(5, "symmetry-args-nested-20000-deep", "--args")(
    lambda f: ["symmetry", "mlp", "--args", '{"hidden": ' + "[" * 20_000 + "]" * 20_000 + "}"]
)
case(5, "fuse-architecture-args-nested-3000-deep", "fuse.yaml")(
    lambda f: [
        "fuse",
        f.text(
            "fuse.yaml",
            "merge_method: average\narchitecture: torch.nn:Linear\narchitecture_args: {a: "
            + "[" * 3000
            + "]" * 3000
            + "}\nmodels: [{model: m0.safetensors}, {model: m1.safetensors}]\n",
        ),
    ]
)
case(5, "spec-from-dict-name-nested-5000-deep", "spec.groups.0.name")(
    lambda f: call(
        __import__("rayfuse.symmetry", fromlist=["PermutationSpec"]).PermutationSpec.from_dict,
        {"groups": [{"name": _deep(5000), "size": 2, "axes": [{"key": "w", "dim": 0}]}]},
    )
)


# ---------------------------------------------------------------------------------------------------------------
# 5. Readers: checkpoints


def _safetensors_huge_header(f: Files) -> list[str]:
    models = f.models()
    f.raw(models[0], (2**60).to_bytes(8, "little") + b"{}")
    return models


def _safetensors_overlong_tensor(f: Files) -> list[str]:
    models = f.models()
    header = json.dumps({"weight": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}).encode()
    f.raw(models[0], len(header).to_bytes(8, "little") + header + bytes(16))
    return models


def _pt_truncated(f: Files) -> list[str]:
    import torch

    names = ["m0.pt", "m1.pt"]
    for name in names:
        torch.save({"weight": torch.ones(4, 3), "bias": torch.zeros(4)}, f.root / name)
    f.raw("m0.pt", (f.root / "m0.pt").read_bytes()[:200])
    return names


case(5, "fuse-safetensors-header-length-2-60", "m0.safetensors")(lambda f: ["fuse", f.fuse(models=_safetensors_huge_header(f))])
case(5, "fuse-safetensors-tensor-beyond-the-file", "m0.safetensors")(lambda f: ["fuse", f.fuse(models=_safetensors_overlong_tensor(f))])
case(5, "fuse-pt-truncated", "m0.pt")(lambda f: ["fuse", f.fuse(models=_pt_truncated(f))])
case(5, "fuse-checkpoint-above-the-memory-available", "(m0.safetensors): weight: expected a merge that fits in memory")(
    Patched(_memory_bound(64), lambda f: ["fuse", f.fuse()])
)
case(5, "api-fuse-checkpoint-above-the-memory-available", "(m0.safetensors): weight: expected a merge that fits in memory")(
    Patched(_memory_bound(64), lambda f: call(rayfuse.fuse, f.fuse()))
)


# ---------------------------------------------------------------------------------------------------------------
# The checks every case passes


@pytest.fixture
def folder(isolated):  # noqa: F811  (the fixture imported above)
    """The case's folder as the working directory, Ray seen as not started (``tests.config.test_bad_inputs``' ``isolated``:
    each case shows what a fresh ``rayfuse`` process does)."""
    return isolated


@pytest.fixture
def fresh_modules(monkeypatch):
    """No ``__pycache__`` written into the case's folder; user modules imported by a case forgotten after it."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("m_"):
            del sys.modules[name]


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_runs_nothing(bad: Case, folder: Path, fresh_modules, capsys, monkeypatch) -> None:
    files = Files(folder)
    command = bad.make(files)
    if isinstance(command, Patched):
        command.patch(files, monkeypatch)
        command = command.make(files)
    capsys.readouterr()
    before = _snapshot(folder)
    line = refused_line(command, capsys)
    assert bad.names in line, line
    assert _snapshot(folder) == before
    if bad.sentinel is not None:
        assert not (folder / bad.sentinel).exists(), "the config ran code"


def test_the_table_covers_both_classes() -> None:
    counts = {cls: sum(1 for c in CASES if c.cls == cls) for cls in (3, 5)}
    assert counts[3] >= 20 and counts[5] >= 40, counts
    assert len({c.id for c in CASES}) == len(CASES)


def test_the_unfixed_code_would_have_run_the_command(folder: Path) -> None:
    """The sentinel does what the class 3 cases say it would: called, os.system creates it (so its absence there shows
    the command was never run)."""
    import os

    os.system(SHELL["command"])
    assert (folder / SENTINEL).exists()


# ---------------------------------------------------------------------------------------------------------------
# Valid but unusual inputs that must keep working


VALID: dict[str, Callable[[Files], Any]] = {}


def valid(id: str) -> Callable[[Callable[[Files], Any]], Callable[[Files], Any]]:
    def add(check: Callable[[Files], Any]) -> Callable[[Files], Any]:
        VALID[id] = check
        return check

    return add


def _fused(f: Files, command: list[str]) -> None:
    assert main(command) == 0
    assert (f.root / "fused.safetensors").is_file()


@valid("architecture-user-function")
def _(f: Files) -> None:
    _fused(f, fuse_arch(f, module(f, "m_ok_function", NET + "\ndef make(width=4):\n    return Net(3, width)\n") + ":make", {"width": 4}))


@valid("architecture-classmethod-of-a-module")
def _(f: Files) -> None:
    _fused(f, fuse_arch(f, module(f, "m_ok_classmethod", NET) + ":Net.small"))


@valid("architecture-staticmethod-of-a-module")
def _(f: Files) -> None:
    _fused(f, fuse_arch(f, module(f, "m_ok_staticmethod", NET) + ":Net.build"))


@valid("architecture-module-class-from-an-installed-package")
def _(f: Files) -> None:
    _fused(f, fuse_arch(f, "torch.nn:Linear", {"in_features": 3, "out_features": 4}))


@valid("architecture-module-prints-and-parses-optional-arguments-at-import")
def _(f: Files) -> None:
    body = "import argparse\nprint('importing the nets')\nARGS = argparse.ArgumentParser().parse_known_args()[0]\n" + NET
    _fused(f, fuse_arch(f, module(f, "m_ok_prints", body) + ":Net"))


@valid("architecture-module-sees-a-neutral-argv")
def _(f: Files) -> None:
    body = "import sys\nassert sys.argv == ['-c'], sys.argv\n" + NET
    _fused(f, fuse_arch(f, module(f, "m_ok_argv", body) + ":Net"))


@valid("model-returning-a-tuple")
def _(f: Files) -> None:
    _fused(f, fuse_model(f, "m_ok_tuple", "h = self.fc(x)\nreturn h, torch.relu(h)"))


@valid("model-returning-logits-in-a-mapping")
def _(f: Files) -> None:
    _fused(f, fuse_model(f, "m_ok_mapping", "return {'logits': self.fc(x), 'hidden': x}"))


@valid("model-returning-a-tuple-keeps-its-logits-for-later-calls")
def _(f: Files) -> None:
    import torch

    from rayfuse.models.architecture import build_architecture, check_inputs_fit

    model = build_architecture(model_module(f, "m_ok_hook", "h = self.fc(x)\nreturn h, x"))
    assert check_inputs_fit(model, np.zeros((2, 3), np.float32), where="input_shape") == (2, 4)
    out = model(torch.zeros(5, 3))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (5, 4)
    assert check_inputs_fit(model, np.zeros((2, 3), np.float32), where="input_shape") == (2, 4)  # checked twice: one hook
    assert len(model._forward_hooks) == 1


TUPLE_MLP = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, out.softmax(-1)
"""


@valid("model-returning-a-tuple-matched-and-repaired-on-data")
def _(f: Files) -> None:
    import torch
    from safetensors.torch import save_file

    from rayfuse.models.architecture import build_architecture

    ref = module(f, "m_ok_tuple_mlp", TUPLE_MLP) + ":MLP"
    for seed in range(2):
        torch.manual_seed(seed)
        save_file(build_architecture(ref).state_dict(), str(f.root / f"mlp{seed}.safetensors"))
    data = f.npz(X=np.random.default_rng(0).normal(size=(60, 3)).astype(np.float32), y=np.arange(60) % 2)
    _fused(
        f,
        [
            "fuse",
            f.fuse(
                models=["mlp0.safetensors", "mlp1.safetensors"],
                merge_method="weight_matching",
                architecture=ref,
                data={"path": data},
                parameters={"repair": True},
            ),
        ],
    )


@valid("npz-compressed-fortran-big-endian-extra-member")
def _(f: Files) -> None:
    from rayfuse.data.datasets import read_data_file

    X = np.asfortranarray(np.random.default_rng(0).normal(size=(60, 4)).astype(">f8"))
    zip_npz(f, {"X.npy": npy_bytes(X), "y.npy": npy_bytes(LABELS), "README.txt": b"how the data was made"}, compress=True)
    data = read_data_file("data.npz")
    assert data.X.shape == (60, 4) and np.allclose(data.X, X.astype(np.float32))


@valid("npz-format-2-header")
def _(f: Files) -> None:
    from rayfuse.data.datasets import read_data_file

    X = np.arange(240, dtype="<f4").reshape(60, 4)
    zip_npz(f, {"X.npy": npy_header((60, 4), "<f4", (2, 0)) + X.tobytes(), "y.npy": npy_bytes(LABELS)})
    assert np.array_equal(read_data_file("data.npz").X, X)


@valid("npz-member-with-bytes-after-its-data")
def _(f: Files) -> None:
    from rayfuse.data.datasets import read_data_file

    X = np.arange(240, dtype="<f4").reshape(60, 4)
    zip_npz(f, {"X.npy": npy_bytes(X) + b"trailing", "y.npy": npy_bytes(LABELS)})
    assert np.array_equal(read_data_file("data.npz").X, X)


@valid("npz-run-validates")
def _(f: Files) -> None:
    assert main(["validate", f.job(data={"dataset": "npz", "path": f.npz()})]) == 0


@valid("parquet-dictionary-and-text-labels-boolean-and-decimal-features")
def _(f: Files) -> None:
    import decimal

    import pyarrow as pa

    from rayfuse.data.datasets import read_data_file

    labels = pa.array([f"c{i % 3}" for i in range(60)]).dictionary_encode()
    flags = pa.array([i % 2 == 0 for i in range(60)])
    prices = pa.array([decimal.Decimal(i) / 4 for i in range(60)], pa.decimal128(6, 2))
    data = read_data_file(_parquet_table(f, y=labels, flag=flags, price=prices), features=["a", "flag", "price"])
    assert data.X.shape == (60, 3) and data.class_names == ("c0", "c1", "c2") and data.X[3, 2] == 0.75


@valid("csv-text-labels-distinct-columns")
def _(f: Files) -> None:
    from rayfuse.data.datasets import read_data_file

    data = read_data_file(f.text("data.csv", "a,b,y\n1,2,cat\n3,4,dog\n5,6,cat\n"), kind="csv")
    assert data.X.shape == (3, 2) and data.class_names == ("cat", "dog")


@valid("silo-images-below-the-bounds")
def _(f: Files) -> None:
    train, held = load_image_silo(f, grayscale=True, image_size=[4, 4])()
    assert train.input_shape == (1, 4, 4) and len(train.y) + len(held.y) == 6


@valid("silo-image-size-at-the-bound-validates")
def _(f: Files) -> None:
    image_folder(f)
    assert main(["validate", silo_job(f, {"dataset": "imagefolder", "path": "images", "image_size": [9459, 9459]})]) == 0


MLP = """
from torch import nn


class MLP(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
"""


@valid("spec-json-written-by-rayfuse-symmetry")
def _(f: Files) -> None:
    import torch
    from safetensors.torch import save_file

    ref = module(f, "m_ok_mlp", MLP) + ":MLP"
    spec = rayfuse.api.symmetry(ref, input_shape=[3])
    assert spec.groups, spec.describe()
    f.text("spec.json", json.dumps(spec.to_dict(), indent=1))
    models = []
    for seed in range(2):
        torch.manual_seed(seed)
        save_file(sys.modules["m_ok_mlp"].MLP().state_dict(), str(f.root / f"mlp{seed}.safetensors"))
        models.append(f"mlp{seed}.safetensors")
    _fused(
        f,
        [
            "fuse",
            f.fuse(models=models, merge_method="weight_matching", architecture=ref, input_shape=[3], parameters={"spec": "spec.json"}),
        ],
    )


@valid("spec-with-fields-of-a-later-version")
def _(f: Files) -> None:
    from rayfuse.symmetry import PermutationSpec

    data = {
        "groups": [{"name": "P0", "size": 2, "axes": [{"key": "w", "dim": 0, "start": 0}], "origin": "hand-written"}],
        "fixed": [{"key": "w", "dim": 1, "reason": "input", "by": "me"}],
        "version": 2,
    }
    spec = PermutationSpec.from_dict(data)
    assert spec.groups[0].size == 2 and spec.fixed[0].reason == "input"
    assert PermutationSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("check", list(VALID.values()), ids=list(VALID))
def test_valid_unusual_input_works(check: Callable[[Files], Any], folder: Path, fresh_modules) -> None:
    check(Files(folder))
