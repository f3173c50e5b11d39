"""The package version (`ssmspec.__version__`; calibrations on disk are kept per version; pyproject.toml repeats it)."""

__version__ = "0.1.0"
