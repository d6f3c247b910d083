"""Fine-tunes of one foundation model: merges of full fine-tunes and of LoRA adapters (``rayfuse fuse``)."""
