"""Horovod's build queries, answered for this build: collectives run on MPI (mpi4py over
MPICH) on the CPU; there is no Gloo, NCCL, CUDA, ROCm, oneCCL or DDL code in flyte-hvd."""

from __future__ import annotations


def mpi_built() -> bool:
    """True: every collective runs on MPI."""
    return True


def mpi_threads_supported() -> bool:
    """Whether MPI was initialized with ``MPI_THREAD_MULTIPLE`` (the background thread's
    collectives overlap the calling thread's)."""
    from mpi4py import MPI

    if not MPI.Is_initialized():
        return False
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """Horovod returns the NCCL version it was built with; 0 means none."""
    return 0


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False
