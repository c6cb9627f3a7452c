"""Native helpers for iod: shm segments, atomics on shared words, pinning ready
records, batched copies and GIL-free preads."""

from ._iodnative import (  # noqa: F401
    add_u32,
    address,
    copy_regions,
    cuda_available,
    cuda_copy,
    cuda_device_pointer,
    cuda_register,
    cuda_unregister,
    load_u32,
    load_u64,
    pin_ready,
    pinned,
    pread_full,
    shm_create,
    shm_open_readonly,
    shm_open_rw,
    shm_unlink,
    store_u32,
    store_u64,
    unpin,
    wait_u32,
)
