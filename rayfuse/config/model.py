"""The ``model`` section (and a client's own, ``federation.client_overrides.<i>.model``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from rayfuse.config.base import StrictModel
from rayfuse.errors import key_error, suggest

__all__ = ["ModelConfig"]


class ModelConfig(StrictModel):
    name: str = Field(
        "mlp",
        description="logreg | mlp | cnn | rescnn | vgg | transformer | torchvision:<name> (e.g. torchvision:resnet18) | "
        "hf:<folder> (a local Hugging Face sequence classifier: config.json and its weights; relative to the working "
        "directory; its data: token ids)",
    )
    hidden: list[int] = Field(
        default_factory=lambda: [64, 64], description="mlp, vgg: hidden layer widths; transformer: [width, feed-forward width]"
    )
    channels: list[int] = Field(default_factory=lambda: [16, 32], description="cnn, rescnn, vgg: channels of the 3x3 conv layers")
    heads: int = Field(2, ge=1, description="transformer: attention heads (a divisor of hidden[0])")
    depth: int = Field(2, ge=1, le=64, description="transformer: encoder layers")
    patch_size: int = Field(4, ge=1, description="transformer: patch side on image inputs (a divisor of the image size)")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="mlp, cnn, rescnn, vgg, transformer: dropout probability (after the hidden layers / on the pooled features); 0: none",
    )
    activation: Literal["relu", "tanh", "gelu"] = Field(
        "relu", description="mlp, cnn, rescnn, vgg, transformer: the hidden layers' nonlinearity"
    )
    factory: str | None = Field(
        None,
        description="name: custom: the qualified name of the model factory given to rayfuse.run(model=...) "
        "(a record: a config file cannot hold a Python object, so such a run cannot be resumed from the CLI)",
    )
    # ``name: custom``: the callable itself; not config data, but it travels with the section (by value) to every
    # process that builds the model.
    _factory: Any = PrivateAttr(None)

    @field_validator("hidden", "channels")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(v < 1 for v in value):
            raise ValueError("positive widths")
        return value

    @field_validator("name")
    @classmethod
    def _known_model(cls, value: str) -> str:
        from rayfuse.models.hf import HF_PREFIX, absolute_hf_name
        from rayfuse.models.registry import MODELS, torchvision_model_names

        if value.startswith(HF_PREFIX):
            return absolute_hf_name(value)  # the folder itself is checked where the model is built, before any client
        if value.startswith("torchvision:"):
            tv_name = value.split(":", 1)[1]
            names = torchvision_model_names()
            if tv_name not in names:
                raise ValueError(f"a torchvision classification model name{suggest(tv_name, names)}")
            return value
        if value not in MODELS:
            known = MODELS.names() + ["torchvision:<name>", "hf:<folder>"]
            raise ValueError(f"a model in {{{', '.join(known)}}}{suggest(value, known)}")
        return value

    @model_validator(mode="after")
    def _factory_only_for_custom(self) -> ModelConfig:
        if self.factory is not None and self.name != "custom":
            raise key_error("factory", f"no factory for model {self.name!r} (only name: custom records one), got {self.factory!r}")
        return self

    @property
    def family(self) -> str:
        return "torchvision" if self.name.startswith("torchvision:") else "hf" if self.name.startswith("hf:") else self.name

    @property
    def custom_factory(self) -> Any:
        """The callable of ``name: custom`` (given to ``rayfuse.run(model=...)``); ``None`` otherwise."""
        return self._factory

    def with_factory(self, factory: Any, qualname: str) -> ModelConfig:
        """A copy that builds its model with ``factory`` (``name: custom``, ``factory: qualname``)."""
        copy_ = self.model_copy(update={"name": "custom", "factory": qualname})
        copy_._factory = factory
        return copy_
