"""What several adapters read and write through (see the package's docstring)."""
