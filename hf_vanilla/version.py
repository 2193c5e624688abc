"""hf_vanilla's version, written once: pyproject.toml reads it, the package exports it, and what is kept on disk
under a key that names the version (runtime="auto"'s decisions) imports it from here."""

__version__ = "0.2.0"
