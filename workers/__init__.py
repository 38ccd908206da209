"""The data plane: everything that runs on a worker (engine, KV cache, model, sampling).

Imported as ``tessera.workers``: the folder is installed under the one import root
``tessera`` (see pyproject.toml). Importing it by its bare name would load a second
copy of every module (and of every class, which breaks isinstance checks), so that fails.
"""

if __name__ != "tessera.workers":
    raise ImportError(f"import tessera.workers, not {__name__}: Tessera has one import root")
