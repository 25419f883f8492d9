"""Fast fp32 matmuls for MLX on Linux CPUs.

The Linux ``mlx[cpu]`` wheel links a slow reference BLAS. Loading OpenBLAS
(Debian's ``libopenblas0-pthread``) with ``RTLD_GLOBAL`` *before* ``mlx.core``
is imported makes MLX resolve its BLAS symbols there: fp32 matmuls get about
20x faster. This module does that once, on Linux only; on macOS (Metal,
Accelerate) and where no OpenBLAS is installed it does nothing.

``import hf2q_py`` calls :func:`preload`. To keep MLX's own BLAS (its
batched and single-token matmuls agree bit for bit), import ``mlx.core``
before ``hf2q_py``; the CLI's ``--no-openblas`` does that for you.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import warnings
from dataclasses import dataclass

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)


@dataclass
class BlasStatus:
    """What :func:`preload` did: ``state`` is one of ``loaded``,
    ``not-linux``, ``not-found``, ``too-late`` or ``pending``."""

    state: str = "pending"
    path: str | None = None


_status = BlasStatus()


def status() -> BlasStatus:
    return _status


def find_openblas() -> str | None:
    """Path of an OpenBLAS shared library, or None."""
    for path in _CANDIDATES:
        if os.path.exists(path):
            return path
    found = glob.glob("/usr/lib/*/openblas*/libopenblas*.so*")
    if found:
        return sorted(found)[0]
    return ctypes.util.find_library("openblas")


def preload() -> BlasStatus:
    """Load OpenBLAS globally before ``mlx.core``; idempotent.

    Warns once when ``mlx.core`` was already imported, so the speed-up could
    not be applied.
    """
    if _status.state != "pending":
        return _status
    if not sys.platform.startswith("linux"):
        _status.state = "not-linux"
    else:
        path = find_openblas()
        if path is None:
            _status.state = "not-found"
        elif "mlx.core" in sys.modules:
            _status.state = "too-late"
            _status.path = path
            warnings.warn(
                "hf2q_py: mlx.core was imported before hf2q_py, so OpenBLAS could "
                "not be loaded first; fp32 matmuls on this CPU use MLX's slow "
                "reference BLAS. Import hf2q_py before mlx to get the speed-up.",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _status.state = "loaded"
            _status.path = path
    return _status
