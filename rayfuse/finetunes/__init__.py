"""Fine-tunes of one foundation model: the tensor-by-tensor merges of ``rayfuse fuse`` and ``merge_method: lora``.

Every merge here is a :class:`~rayfuse.finetunes.tensor_merge.TensorMerge` registered in ``rayfuse fuse``'s one
registry (:mod:`rayfuse.merging.registry`): :mod:`~rayfuse.finetunes.merges` (task arithmetic, TIES, DARE, SLERP, the
averages, Fisher and RegMean, after :mod:`~rayfuse.finetunes.taskvec`'s streaming maths), :mod:`~rayfuse.finetunes.mergekit_set`
(mergekit's breadcrumbs, DELLA, SCE, Model Stock, Karcher, the SLERPs and nearswap) and :mod:`~rayfuse.finetunes.spectral`
(TSV-M, Iso-C / Iso-CTS, WUDI). :mod:`~rayfuse.finetunes.hf` reads and writes model files and Hugging Face folders of
any size, :mod:`~rayfuse.finetunes.config` checks a file against the registered merge and :mod:`~rayfuse.finetunes.run`
streams it tensor by tensor; :mod:`~rayfuse.finetunes.lora` combines PEFT LoRA adapters. The core never imports Ray:
tensors are merged by threads in-process.
"""
