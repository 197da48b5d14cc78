"""flashattn: exact, IO-aware attention (the FlashAttention algorithm) for PyTorch and JAX.

The adapters live in submodules, imported on demand so that neither framework is a dependency
of the other:

    from flashattn.torch import flash_attn_func      # drop-in for flash_attn 2.x
    from flashattn.jax import dot_product_attention  # like jax.nn.dot_product_attention

Errors raised by the library carry its message unchanged; their classes are below
(InvalidArgumentError is a ValueError, UnsupportedError a NotImplementedError).
"""

from flashattn import _ext
from flashattn._ext import (
    DeviceError,
    FlashAttnError,
    InternalError,
    InvalidArgumentError,
    NotCompiledError,
    OutOfMemoryError,
    UnsupportedError,
)

__version__ = _ext.version()

#: Backend names accepted by the ``backend=`` keyword of flashattn.torch and flashattn.jax.
#: "auto" lets the tensors' device choose (the CPU flash backend, or the CUDA kernels);
#: "reference" is the float64 oracle (slow; for tests); "standard" the unfused textbook path.
BACKENDS = {
    "auto": _ext.BACKEND_AUTO,
    "reference": _ext.BACKEND_CPU_REFERENCE,
    "cpu_reference": _ext.BACKEND_CPU_REFERENCE,
    "flash": _ext.BACKEND_CPU_FLASH,
    "cpu_flash": _ext.BACKEND_CPU_FLASH,
    "standard": _ext.BACKEND_CPU_STANDARD,
    "cpu_standard": _ext.BACKEND_CPU_STANDARD,
    "cuda": _ext.BACKEND_CUDA,
}


def backend_id(name):
    """The C ABI's fa_backend value of a backend name (None means "auto")."""
    if name is None:
        return _ext.BACKEND_AUTO
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"backend: must be one of {sorted(BACKENDS)}, got {name!r}"
        ) from None


def window_pair(window_size):
    """flash_attn's window_size (left, right), -1 unbounded, as two ints (flashattn.torch and flashattn.jax)."""
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"window_size: must be a pair (left, right) with -1 for unbounded, got {window_size!r}"
        ) from None


def check_fp8_scales(fp8_cache, k_scale, v_scale):
    """A float8_e4m3fn cache needs both dequantisation scales (flash_attn_with_kvcache, torch and jax)."""
    if fp8_cache and (k_scale is None or v_scale is None):
        raise InvalidArgumentError(("k_scale" if k_scale is None else "v_scale") + ": required with a float8_e4m3fn "
                                   "cache (real value = fp8 value * scale)")


def build_info():
    """What this build holds: backends, compiled CUDA head dims and dtypes, XLA FFI support."""
    jax_line = "xla ffi: " + (
        "compiled (flashattn.jax available)" if _ext.has_xla_ffi else "not compiled (build without jaxlib)"
    )
    return _ext.build_info() + jax_line + "\n"


def cuda_device_count():
    """Number of CUDA devices the library sees (0 without CUDA in the build or without a GPU)."""
    return _ext.cuda_device_count()


__all__ = [
    "BACKENDS",
    "DeviceError",
    "FlashAttnError",
    "InternalError",
    "InvalidArgumentError",
    "NotCompiledError",
    "OutOfMemoryError",
    "UnsupportedError",
    "backend_id",
    "build_info",
    "check_fp8_scales",
    "cuda_device_count",
    "window_pair",
]
