"""Crucible's services; each runs as `python -m crucible.services.<name>` and imports only `crucible.shared` and `crucible.ml`.

Importing any of them first sets how this process's malloc treats what it frees
(`Settings.malloc_keep_freed`, shared/procs.py `keep_freed_memory`). It is done here, before a service
imports torch: that import starts a thread, and glibc fixes the number of malloc arenas a process may
have once a second thread allocates, so a service's own start-up (`service.setup`) is too late.
"""
import os as _os

from pydantic import TypeAdapter as _TypeAdapter

from crucible.shared import procs as _procs
from crucible.shared.settings import Settings as _Settings


def _keep_freed_memory() -> bool:
    """The setting as Settings reads it (CRUCIBLE_MALLOC_KEEP_FREED, its default otherwise), without
    reading every other one here: a bad value of another setting is for the service to report."""
    raw = _os.environ.get("CRUCIBLE_MALLOC_KEEP_FREED")
    if raw is None:
        return _Settings.model_fields["malloc_keep_freed"].default
    try:
        return _TypeAdapter(bool).validate_python(raw)
    except ValueError:
        return _Settings.model_fields["malloc_keep_freed"].default  # the service's Settings() says what is wrong


if _keep_freed_memory():
    _procs.keep_freed_memory()
