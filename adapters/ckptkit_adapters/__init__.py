"""ckptkit's adapters: one package per tool (``hf``, ``megatron``, ``deepspeed``, ``dcp``, ``peft``, ``zarr``), each
holding the tool's reader, writer and view and exposing ``ADAPTER`` (a `ckptkit.adapters.Adapter`),
registered in the ``ckptkit.adapters`` entry-point group. ``common`` holds what several adapters read
and write through: pickles read safely (``safepickle``), ``torch.save`` archives read in place
(``torchsave``), small files and safetensors headers (``files``), fp32 masters rounded as frameworks
round (``floats``), numpy's generator states (``numpy_pickle``), and the torch DCP container (``dcp_metadata``, ``dcp_read``, ``dcp_write``), which
Megatron-Core's ``torch_dist`` is too. An adapter imports ckptkit and ``common``, never another adapter."""
