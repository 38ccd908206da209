"""The .proto files of tessera.v1 and their generated stubs.

Imported as ``tessera.protos``: the folder is installed under the one import root
``tessera`` (see pyproject.toml). Importing it by its bare name would load a second
copy of every module (and of every class, which breaks isinstance checks), so that fails.
"""

if __name__ != "tessera.protos":
    raise ImportError(f"import tessera.protos, not {__name__}: Tessera has one import root")
