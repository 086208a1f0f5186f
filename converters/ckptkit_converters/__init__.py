"""Adapters between other frameworks' checkpoint formats and ckptkit's one representation.

Installed as the import package ``ckptkit_converters``; the core package never imports it.
Each converter is one module exposing ``CONVERTER``, an object satisfying
``ckptkit.ops.convert.Converter`` (``name``, ``description``, a cheap ``detect(path)`` and
``convert(src, dst, *, allow_skip, progress)`` returning a ``ConvertReport``), registered under
its name in the ``ckptkit.converters`` entry-point group (see pyproject.toml); a converter that
needs its framework brings it as an optional extra and imports it lazily.

- ``dcp``: torch.distributed.checkpoint directories (no torch needed to read them).

Shared pieces: ``safepickle`` (unpickling with an allowlist of stand-ins, never running the
file's code) and ``torchsave`` (``torch.save`` archives read in place).
"""
