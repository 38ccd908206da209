"""The control plane: placement, the worker registry, admission, autoscaling.

Imported as ``tessera.scheduler``: the folder is installed under the one import root
``tessera`` (see pyproject.toml). Importing it by its bare name would load a second
copy of every module (and of every class, which breaks isinstance checks), so that fails.
"""

if __name__ != "tessera.scheduler":
    raise ImportError(f"import tessera.scheduler, not {__name__}: Tessera has one import root")
