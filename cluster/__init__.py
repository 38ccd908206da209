"""The way in: configuration, launch, the Ray Serve app (HTTP), gRPC, the CLI, metrics.

Imported as ``tessera.cluster``: the folder is installed under the one import root
``tessera`` (see pyproject.toml). Importing it by its bare name would load a second
copy of every module (and of every class, which breaks isinstance checks), so that fails.
"""

if __name__ != "tessera.cluster":
    raise ImportError(f"import tessera.cluster, not {__name__}: Tessera has one import root")
