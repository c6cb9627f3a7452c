"""Native helpers for iod: shm segments, acquire/release atomics, GIL-free preads."""

from ._iodnative import (  # noqa: F401
    load_acquire_u32,
    load_acquire_u64,
    pread_full,
    shm_create,
    shm_open_readonly,
    shm_unlink,
    store_release_u32,
    store_release_u64,
)
