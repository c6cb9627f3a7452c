import sys

from setuptools import Extension, setup

# shm_open lives in librt on older glibc; macOS has it in libc.
libraries = ["rt", "dl"] if sys.platform.startswith("linux") else []

setup(
    ext_modules=[
        Extension(
            "native._iodnative",
            ["native/iodnative.c"],
            libraries=libraries,
            extra_compile_args=["-O2", "-Wall"],
        )
    ]
)
