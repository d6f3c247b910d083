"""The one schema of a ``rayfuse fuse`` file, whatever the merge: mergekit's keys (``merge_method``, ``base_model``,
``models`` with their ``parameters``, ``parameters``, ``dtype`` / ``out_dtype``, ``output``) and rayfuse's own
(``architecture`` and a ``data`` sample for the merges that read the models' class or data, per-model ``statistics``
for Fisher / RegMean, ``output_kind`` for LoRA adapters, ``max_shard_size``, ``threads``, ``seed``).

Which keys a merge takes is the registered method's to say (:mod:`rayfuse.merging.registry`): the file is validated
here once, then :func:`rayfuse.merging.run.load_fuse_config` refuses, in one line naming the key and the method, a key
the method does not read. A method's ``parameters`` are checked against the names it declares.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from rayfuse.config import StrictSchema

__all__ = ["FuseFile", "FuseModel", "FuseData", "DTYPE"]

DTYPE = Literal["bfloat16", "float16", "float32", "float64"]


class FuseModel(StrictSchema):
    model: str = Field(
        min_length=1,
        description="a .safetensors / .pt / .pth / .bin file, a shard folder, a Hugging Face folder or a PEFT adapter "
        "folder (relative to the fuse file)",
    )
    parameters: dict[str, Any] = Field(default_factory=dict, description="this model's parameters (weight, density, ...)")
    statistics: str | None = Field(
        None,
        min_length=1,
        description="fisher / regmean: a .safetensors file of this model's diagonal Fisher (the tensors' names and "
        "shapes) or its layers' input Gram matrices (a weight's name -> (in, in); an embedding table's -> its rows' "
        "use counts, (rows,))",
    )
    architecture: str | None = Field(
        None,
        min_length=3,
        description="this model's class when it is not the file's architecture (merges of models of different architectures: distill)",
    )
    architecture_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for this model's architecture")


class FuseData(StrictSchema):
    path: str = Field(
        min_length=1,
        description="an .npz file (relative to the fuse file) with the inputs as the model takes them; with text: a .jsonl, "
        ".csv, .parquet or .txt file of texts (Hugging Face folders: fisher, regmean, adamerging, distill)",
    )
    features: str = Field("X", min_length=1, description="the inputs' array name (.npz)")
    label: str | None = Field(
        None,
        min_length=1,
        description="the labels' array name (.npz; default y), or with text the label column (fisher only: the empirical "
        "Fisher at these labels); merges that read no labels ignore it (.npz) or refuse it (text)",
    )
    text: str | None = Field(
        None,
        min_length=1,
        description="the text column of a .jsonl / .csv / .parquet file (a .txt file: any name, one text a line): the data "
        "are texts, tokenised with the base_model's (else the first model's) tokenizer",
    )
    max_length: int | None = Field(
        None, ge=2, description="text: tokens a text is padded or truncated to (default: the longest text's, at most the model's positions)"
    )


class FuseFile(StrictSchema):
    merge_method: str = Field(min_length=1, description="a registered merge (rayfuse list merges) or one of its aliases")
    models: list[FuseModel] = Field(min_length=1)
    base_model: str | None = Field(None, min_length=1, description="the model the others are fine-tunes of")
    parameters: dict[str, Any] = Field(default_factory=dict, description="the merge's global parameters")
    architecture: str | None = Field(None, min_length=3, description='"module:Class" or "torchvision:<name>": the models\' class')
    architecture_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the architecture")
    input_shape: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, min_length=1, description="one input's shape, to trace the architecture when no data is given (e.g. [3, 32, 32])"
    )
    data: FuseData | None = Field(None, description="a sample the merges that need data run on (activation matching, repair)")
    vocab: int | None = Field(
        None,
        ge=1,
        description="the models take token ids in [0, vocab) (Hugging Face models): input_shape is then the ids' shape "
        "(e.g. [16]) and the example batch random ids; data: X must hold such ids",
    )
    dtype: DTYPE | None = Field(None, description="the output's float dtype (default: the inputs')")
    out_dtype: DTYPE | None = Field(None, description="mergekit's name for dtype; overrides it")
    output: str | None = Field(None, min_length=1)
    output_kind: Literal["adapter", "merged"] | None = Field(
        None,
        description="lora: adapter (a PEFT adapter folder, the default) or merged (the base with the update folded in, "
        "a Hugging Face folder)",
    )
    max_shard_size: int | str | None = Field(
        None,
        description='an output above this size is a folder of shards and their model.safetensors.index.json ("2GB", '
        '"500MB" or bytes; default 2 GiB; rayfuse fuse --max-shard-size)',
    )
    threads: int | None = Field(None, ge=1, description="tensors merged at once (default: the CPU count, at most 8)")
    seed: int | None = Field(None, description="the seed of the merges' random drops (DARE, DELLA; default 0)")
