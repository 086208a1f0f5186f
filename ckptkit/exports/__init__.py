"""Exports to other tools' formats: the table of formats and the options each takes (``formats``), each
format's writer in its own module (``hf_writer`` with the names and configs of ``hf``, ``dcp`` and
``fsdp2``, ``zarr_form``, ``megatron``, ``deepspeed``), driven by ``run.export`` over a
``source.Source``; ``convert`` changes dtypes."""
