"""The embedded local backend: bubblewrap, cgroups and seccomp on this host.

Everything here serves :class:`LocalBackend`; nothing outside this folder imports its
modules but the tools that report on it (``tangram doctor``).
"""

from ._backend import LocalBackend as LocalBackend
