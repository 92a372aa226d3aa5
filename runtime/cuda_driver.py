"""The few CUDA driver API calls needed to launch a shipped cubin, through ctypes on libcuda.

Why not Triton's launcher: the GPU machine may run a different Triton (or none). A cubin plus the
metadata recorded at build time (entry name, parameter list, num_warps, shared memory, grid rule)
is all the driver needs: cuModuleLoadData, cuModuleGetFunction, cuFuncSetAttribute for more than
48 KiB of dynamic shared memory, and cuLaunchKernel with one pointer per parameter — including
the trailing scratch pointers Triton 3.x appends to every kernel (global and profile scratch).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, Sequence

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
STATIC_SHARED_LIMIT = 48 * 1024

_CTYPES: dict[str, type[ctypes._SimpleCData[Any]]] = {
    "i32": ctypes.c_int32, "u32": ctypes.c_uint32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64,
    "f32": ctypes.c_float, "u8": ctypes.c_uint8, "ptr": ctypes.c_uint64}


class CudaError(RuntimeError):
    pass


def _load_library() -> ctypes.CDLL:
    for name in ("libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CudaError("libcuda not found (no NVIDIA driver on this machine)")


class Driver:
    """A thin, checked wrapper over libcuda (one per process is enough)."""

    def __init__(self) -> None:
        self.lib = _load_library()
        lib = self.lib
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuModuleUnload.argtypes = [ctypes.c_void_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuLaunchKernel.argtypes = [
            ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
        ]
        self.check(lib.cuInit(0), "cuInit")

    def check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise CudaError(f"{what} failed: {(name.value or b'?').decode()} ({result})")

    def version(self) -> int:
        """Driver's CUDA version as an int, e.g. 12080 for 12.8."""
        v = ctypes.c_int()
        self.check(self.lib.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        return v.value

    def ensure_context(self, device: int) -> None:
        """Make the device's primary context current (the one torch uses) if none is."""
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load_function(self, image: bytes, entry: str, shared: int) -> tuple[int, int]:
        """(module, function) handles for `entry` in a cubin image, with its shared memory set up."""
        module = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(image, len(image))
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), buf), "cuModuleLoadData")
        fn = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), module, entry.encode()), f"cuModuleGetFunction({entry})")
        if shared > STATIC_SHARED_LIMIT:
            self.check(self.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                       "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        assert module.value is not None and fn.value is not None  # both set by the calls checked above
        return module.value, fn.value

    def launch(self, function: int, grid: Sequence[int], threads: int, shared: int, stream: int,
               args: Sequence[tuple[str, Any]]) -> None:
        """Launch with `args` as (ctype name, value) pairs, in the kernel's parameter order."""
        values = [_CTYPES[kind](value) for kind, value in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        self.check(self.lib.cuLaunchKernel(ctypes.c_void_p(function), grid[0], grid[1], grid[2], threads, 1, 1, shared,
                                           ctypes.c_void_p(stream), params, None), "cuLaunchKernel")


_DRIVER: Driver | None = None


def driver() -> Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = Driver()
    return _DRIVER
