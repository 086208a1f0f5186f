"""Exports to other tools' formats: the table of formats and the options each takes (``formats``,
read from the tools' adapters, which hold each format's writer), driven by ``run.export`` over a
``source.Source``; ``convert`` changes dtypes; ``adamw`` is a checkpoint's AdamW as the exports
that resume training write it."""
