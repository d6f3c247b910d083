"""A tiny Hugging Face sequence classifier, built from a config and saved with save_pretrained: nothing is downloaded.

::

    python examples/make_tiny_hf.py runs/tiny-bert                 # a 2-layer BERT of width 64 for the `tokens` data
    python examples/make_tiny_hf.py runs/tiny-bert --vocab 32 --length 16 --classes 2 --seed 0

The folder (``config.json`` + ``model.safetensors``) is the model and the base of ``jobs/fedlora_hf.yaml``
(``model: {name: "hf:runs/tiny-bert"}``). Its weights are a seeded random initialisation: the stand-in for a
pretrained model where none may be downloaded. The defaults fit the ``tokens`` dataset's defaults (``vocab`` 32, rows
of 16 ids, 2 classes); a model for other data needs ``--vocab`` at least the data's ``vocab`` and ``--length`` at
least its rows' ``length``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_tiny_hf(
    folder: str | Path,
    *,
    vocab: int = 32,
    length: int = 16,
    classes: int = 2,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``BertForSequenceClassification`` (``layers`` layers of width ``hidden``, feed-forward
    ``2 * hidden``, no dropout) for ``classes`` classes, token ids below ``vocab`` and rows of at most ``length`` ids,
    in ``folder``; return the folder."""
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=length,
        num_labels=classes,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to save the model (config.json + model.safetensors)")
    parser.add_argument("--vocab", type=int, default=32, help="token ids below this (default 32: the tokens dataset's)")
    parser.add_argument("--length", type=int, default=16, help="longest row of token ids (default 16)")
    parser.add_argument("--classes", type=int, default=2, help="number of classes (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="encoder layers (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    args = parser.parse_args()
    folder = make_tiny_hf(
        args.folder, vocab=args.vocab, length=args.length, classes=args.classes, hidden=args.hidden, layers=args.layers, seed=args.seed
    )
    print(f"saved a tiny BERT sequence classifier in {folder}")


if __name__ == "__main__":
    main()
