"""Exports to other tools' formats: Hugging Face (``hf`` names and configs), torch DCP (``dcp``) and
the zarr form (``zarr_form``), driven by ``run.export`` over a ``source.Source``; ``convert`` changes dtypes."""
