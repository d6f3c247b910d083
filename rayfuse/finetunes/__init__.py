"""Fine-tunes of one foundation model (``rayfuse fuse`` with ``base_model:``, and ``merge_method: lora``).

Task-vector merges (task arithmetic, TIES, DARE), SLERP and linear averages of Hugging Face checkpoints of any size,
streamed tensor by tensor: :mod:`rayfuse.finetunes.taskvec` holds the merges, :mod:`rayfuse.finetunes.hf` the reading
and writing of Hugging Face folders, :mod:`rayfuse.finetunes.config` the fuse file and :mod:`rayfuse.finetunes.run`
the streaming loop; :mod:`rayfuse.finetunes.lora` combines PEFT LoRA adapters. The core never imports Ray: tensors are merged by threads in-process.
"""
