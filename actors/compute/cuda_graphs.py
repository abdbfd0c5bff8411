"""CUDA graph capture and replay through libcuda itself, with ctypes: the PyCUDA build this
project ships (2026.1) wraps no graph API. The calls act on the current context, which is
PyCUDA's, so captured launches are PyCUDA's kernel launches on a PyCUDA stream (actors.compute.cuda
uses it; the emulator of tests/ stands in for it where no driver is)."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pycuda.driver as cuda

# CUstreamCaptureMode RELAXED: PyCUDA's launch also calls cuFuncSetBlockShape (a legacy,
# not stream-ordered call) before each cuLaunchKernel; the stricter modes may refuse it.
CAPTURE_RELAXED = 2


class DriverError(RuntimeError):
    """A CUDA driver call made through ctypes (the graph API) returned an error."""


class DriverGraphs:
    """The graph calls of libcuda.so.1, each checked (a failure raises DriverError)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        void_p, p_void_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        signatures = {
            "cuStreamBeginCapture_v2": (void_p, ctypes.c_int),
            "cuStreamEndCapture": (void_p, p_void_p),
            "cuGraphInstantiateWithFlags": (p_void_p, void_p, ctypes.c_ulonglong),
            "cuGraphLaunch": (void_p, void_p),
            "cuGraphExecDestroy": (void_p,),
            "cuGraphDestroy": (void_p,),
            "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        self._lib = lib

    def _check(self, name: str, *args: Any) -> None:
        code = getattr(self._lib, name)(*args)
        if code != 0:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(code, ctypes.byref(text))
            message = text.value.decode() if text.value else "unknown error"
            raise DriverError(f"{name} failed: {message} (CUresult {code})")

    def capture(self, stream: cuda.Stream, enqueue: Any) -> int:
        """Capture what `enqueue()` puts on `stream` into an executable graph (its handle)."""
        handle = ctypes.c_void_p(stream.handle)
        self._check("cuStreamBeginCapture_v2", handle, CAPTURE_RELAXED)
        graph = ctypes.c_void_p()
        try:
            enqueue()
        except BaseException:
            # End the capture, or the stream stays in capture mode; but raise what enqueue
            # raised, not the end-capture error the broken capture then gives.
            self._lib.cuStreamEndCapture(handle, ctypes.byref(graph))
            if graph.value:
                self._lib.cuGraphDestroy(graph)
            raise
        self._check("cuStreamEndCapture", handle, ctypes.byref(graph))
        try:
            executable = ctypes.c_void_p()
            self._check("cuGraphInstantiateWithFlags", ctypes.byref(executable), graph, 0)
        finally:
            self._check("cuGraphDestroy", graph)
        return int(executable.value)

    def launch(self, executable: int, stream: cuda.Stream) -> None:
        self._check("cuGraphLaunch", ctypes.c_void_p(executable), ctypes.c_void_p(stream.handle))

    def destroy(self, executable: int) -> None:
        self._check("cuGraphExecDestroy", ctypes.c_void_p(executable))
