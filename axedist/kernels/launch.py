"""Launch a compiled Triton kernel without Triton's per-call Python binding.

`kernel[grid](...)` re-derives the specialization of every argument, looks the kernel up by a
string key and builds launch metadata on every call: about 40 us of CPU for the collectives'
30 arguments (docs/gpu_notes.md, v2 profile), more than the whole device time of a 1 MB
reduce-scatter. Here the kernel is compiled once for an explicit signature (the same
`compile_for_target` the CPU tests use, with the device's own capability) and each call goes
straight to the generated C launcher with integer addresses (no `data_ptr()` calls, no
`cuPointerGetAttribute`).

    >>> compiled = compile_for_target(all_gather_kernel, signature, constexprs, ["x_ptr"], 90)
    >>> launch = CompiledLaunch(compiled, constexprs.values())
    >>> launch(grid=16, stream=torch.cuda.current_stream().cuda_stream,
    ...        args=(x.data_ptr(), out.data_ptr(), 7, 30_000_000_000, ...))  # runtime arguments

The caller owns the specialization: it must pass values that satisfy the compiled signature
(types, and the arguments declared divisible by 16; it compiles another kernel for others).

Tensor-descriptor (TMA) arguments: Triton's launcher encodes every descriptor into a CUDA tensor
map on every call. `descriptor_arguments` encodes one once (the caller caches it by address,
shape, strides and block) and `launch_expanded` passes the encoded arguments straight to the C
launcher.
"""
from __future__ import annotations

import inspect

import torch

from ..caches import cached
from ..env import read as read_environment


@cached(maxsize=None)
def multiprocessors(device_index: int) -> int:
    """SMs of a CUDA device (the persistent kernels' grid bound), asked once per device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class CompiledLaunch:
    """A compiled kernel (`triton.compile` output) ready to launch on the current CUDA device.

    constexpr_values: the kernel's compile-time arguments in order; the generated launcher
    parses them too (and ignores them), after the runtime arguments.
    """

    def __init__(self, compiled, constexpr_values: tuple):
        self.compiled = compiled
        self.name = compiled.name
        self.constexpr_values = tuple(constexpr_values)
        launcher = compiled.run  # loads the module into the current device's context
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        needs_scratch = (getattr(launcher, "global_scratch_size", 0) or 0) > 0 or \
                        (getattr(launcher, "profile_scratch_size", 0) or 0) > 0
        raw = getattr(launcher, "launch", None)
        if raw is not None and not needs_scratch and hasattr(launcher, "launch_pdl"):
            self._raw = raw
            self._cooperative = bool(launcher.launch_cooperative_grid)
            self._pdl = bool(launcher.launch_pdl)
        else:  # another Triton layout, or a kernel that needs scratch memory: Triton's launcher
            self._raw = None
            self._launcher = launcher
        # Triton wraps the C launcher in a Python function that encodes tensor descriptors;
        # the C function itself takes them encoded (launch_expanded), and scratch memory
        closure = inspect.getclosurevars(raw).nonlocals if inspect.isfunction(raw) else {}
        self._c_launch = closure.get("launcher", raw) if hasattr(launcher, "launch_pdl") else None
        if self._c_launch is not None:
            self._cooperative = bool(launcher.launch_cooperative_grid)
            self._pdl = bool(launcher.launch_pdl)
        self.scratch_bytes = getattr(compiled.metadata, "global_scratch_size", 0) or 0
        signature = list(getattr(compiled.src, "signature", {}).values())
        self.descriptor_positions = [i for i, kind in enumerate(signature)
                                     if isinstance(kind, str) and kind.startswith("tensordesc")]
        meta = getattr(compiled.metadata, "tensordesc_meta", None) or \
            [None] * len(self.descriptor_positions)
        self._descriptor_meta = dict(zip(self.descriptor_positions, meta))

    def __call__(self, grid: int, stream: int, args: tuple) -> None:
        if self._raw is not None:
            self._raw(grid, 1, 1, stream, self.function, self._cooperative, self._pdl, None, None,
                      self.metadata, None, None, None, *args, *self.constexpr_values)
        else:
            self._launcher(grid, 1, 1, stream, self.function, self.metadata, None, None, None,
                           *args, *self.constexpr_values)

    def descriptor_arguments(self, position: int, descriptor) -> list:
        """What the C launcher takes for the tensor-descriptor argument at `position` (the
        CUDA tensor map encoded from `descriptor`, then its shape and strides); encode once,
        reuse for every call on the same memory."""
        from triton.backends.nvidia.driver import make_tensordesc_arg
        return make_tensordesc_arg(descriptor, self._descriptor_meta[position])

    def launch_expanded(self, grid: int, stream: int, args: list, scratch: int | None = None):
        """Launch with the runtime arguments in the C launcher's form: every tensor-descriptor
        argument replaced by its descriptor_arguments, everything else an int or None.
        scratch: the address of grid * scratch_bytes of global scratch memory, for a kernel
        that needs it (device-built TMA descriptors)."""
        if self._c_launch is None:
            raise RuntimeError(f"{self.name}: another Triton launcher layout; launch_expanded "
                               f"cannot run it")
        if self.scratch_bytes and scratch is None:
            raise ValueError(f"{self.name} needs {self.scratch_bytes} bytes of scratch per program")
        self._c_launch(grid, 1, 1, stream, self.function, self._cooperative, self._pdl, scratch,
                       None, self.metadata, None, None, None, *args, *self.constexpr_values)

    def __repr__(self) -> str:
        return f"CompiledLaunch({self.name}, {self.compiled.metadata.target}, " \
               f"warps={self.compiled.metadata.num_warps})"


@cached(maxsize=None)
def copy_engine_runtime():
    """cuda-python's runtime bindings (`cuda.bindings.runtime`) where installed, else None: what
    copy_rows_async issues its copies through (a copy costs a few us of CPU there, against
    about 10 us through torch's `copy_` and stream context)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime


def copy_rows_async(runtime, target: int, target_pitch: int, source: int, source_pitch: int,
                    row_bytes: int, rows: int, stream: int) -> None:
    """`rows` rows of `row_bytes` from address `source` (pitch bytes apart) to `target` on CUDA
    stream handle `stream`: one cudaMemcpy2DAsync, which a copy engine runs where the target is
    a peer GPU's memory mapped here. Raises on a CUDA error."""
    (error,) = runtime.cudaMemcpy2DAsync(target, target_pitch, source, source_pitch, row_bytes,
                                         rows, runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                         stream)
    if int(error) != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync of {rows} x {row_bytes} bytes failed: {error}")


def copy_bytes_async(runtime, target: int, source: int, nbytes: int, stream: int) -> None:
    """`nbytes` contiguous bytes from address `source` to `target` on CUDA stream handle
    `stream` (one cudaMemcpyAsync: a 1-D copy, whose source a StreamGraph can change per
    launch). Raises on a CUDA error."""
    (error,) = runtime.cudaMemcpyAsync(target, source, nbytes,
                                       runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)
    if int(error) != 0:
        raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes failed: {error}")


@cached(maxsize=None)
def stream_memory_driver():
    """cuda-python's driver bindings (`cuda.bindings.driver`) where installed, else None: what
    wait_value_async and take_flag_async issue their stream waits through."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def wait_value_async(driver, stream: int, address: int, value: int) -> None:
    """Stream `stream` (a CUDA stream handle) waits until the int32 at device address `address`
    is >= value (cuStreamWaitValue32, GEQ: compared modulo 2**32): what a copy that must follow
    part of a running kernel waits on. Raises on a CUDA error."""
    (error,) = driver.cuStreamWaitValue32(
        driver.CUstream(stream), driver.CUdeviceptr(address), value,
        driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    if int(error) != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed: {error}")


def take_flag_async(driver, stream: int, address: int) -> None:
    """Stream `stream` (a CUDA stream handle) waits until the int32 at device address `address`
    is non-zero, then sets it to zero (cuStreamWaitValue32 with AND over every bit, then
    cuStreamWriteValue32): a flag a kernel raises once per call and the stream takes down, so
    the same two operations serve every call (a StreamGraph replays them). The kernel of the
    next call must be ordered after the zeroing (its stream waits for this one's). Raises on a
    CUDA error."""
    handle, flag = driver.CUstream(stream), driver.CUdeviceptr(address)
    (error,) = driver.cuStreamWaitValue32(handle, flag, 0xFFFFFFFF,
                                          driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_AND)
    if int(error) == 0:
        (error,) = driver.cuStreamWriteValue32(
            handle, flag, 0, driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    if int(error) != 0:
        raise RuntimeError(f"taking a stream flag down failed: {error}")


class StreamGraph:
    """Work issued on a few CUDA streams, captured once as one CUDA graph and then launched
    with one call: cudaGraphLaunch costs a few us of CPU however many copies and stream waits
    the graph holds, where issuing each of them costs about 4 us (results/probe_ce_host.md).
    issue(): queues the work on `streams` (torch streams; captured in relaxed mode, so other
    threads' CUDA calls are not disturbed); the first stream forks to the others and joins
    them back. Only addresses and values fixed at capture may appear in the work. Raises
    RuntimeError where the driver cannot capture or instantiate it (the caller may then issue
    the same work per call).

    >>> graph = StreamGraph(side_streams, lambda: issue(handles))
    >>> graph.launch(side_streams[0].cuda_stream)   # after what that stream queued before
    """
    _dropped: list = []  # (executable, graph) of graphs dropped since the last one was made

    def __init__(self, streams: list, issue) -> None:
        # (__del__ appends through self.dropped: no global lookup at interpreter exit)
        self.graph, self.executable, self.dropped = None, None, StreamGraph._dropped
        self.runtime = runtime = copy_engine_runtime()
        first = streams[0]
        StreamGraph.destroy_dropped(runtime)
        (error,) = runtime.cudaStreamBeginCapture(
            first.cuda_stream, runtime.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
        if int(error) != 0:
            raise RuntimeError(f"cudaStreamBeginCapture failed: {error}")
        try:
            for stream in streams[1:]:
                stream.wait_stream(first)
            issue()
            for stream in streams[1:]:
                first.wait_stream(stream)
        finally:
            error, self.graph = runtime.cudaStreamEndCapture(first.cuda_stream)
        if int(error) != 0:
            raise RuntimeError(f"cudaStreamEndCapture failed: {error}")
        error, self.executable = runtime.cudaGraphInstantiate(self.graph, 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaGraphInstantiate failed: {error}")

    def copy_nodes(self) -> dict[int, object]:
        """The graph's memcpy nodes by target address (what `set_copy` takes)."""
        runtime = self.runtime
        error, _, count = runtime.cudaGraphGetNodes(self.graph, 0)
        if int(error) == 0:
            error, nodes, count = runtime.cudaGraphGetNodes(self.graph, count)
        if int(error) != 0:
            raise RuntimeError(f"cudaGraphGetNodes failed: {error}")
        found = {}
        for node in nodes[:count]:
            error, kind = runtime.cudaGraphNodeGetType(node)
            if int(error) == 0 and kind == runtime.cudaGraphNodeType.cudaGraphNodeTypeMemcpy:
                error, params = runtime.cudaGraphMemcpyNodeGetParams(node)
                if int(error) == 0:
                    found[int(params.dstPtr.ptr)] = node
            if int(error) != 0:
                raise RuntimeError(f"reading the graph's copy nodes failed: {error}")
        return found

    def set_copy(self, node, target: int, source: int, nbytes: int) -> None:
        """The next launches' copy of `node` (a 1-D copy when captured): `nbytes` from `source`
        to `target` (cudaGraphExecMemcpyNodeSetParams1D; a launch already queued keeps the
        copy it had)."""
        runtime = self.runtime
        (error,) = runtime.cudaGraphExecMemcpyNodeSetParams1D(
            self.executable, node, target, source, nbytes,
            runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice)
        if int(error) != 0:
            raise RuntimeError(f"cudaGraphExecMemcpyNodeSetParams1D failed: {error}")

    def launch(self, stream: int) -> None:
        """The captured work, once, on CUDA stream handle `stream`, after what it queued."""
        (error,) = self.runtime.cudaGraphLaunch(self.executable, stream)
        if int(error) != 0:
            raise RuntimeError(f"cudaGraphLaunch failed: {error}")

    def __del__(self) -> None:
        # destroyed when the next graph is made (outside any capture), not now: the last
        # reference may go while the caller captures a CUDA graph, which a destroy would break
        self.dropped.append((self.executable, self.graph))

    @staticmethod
    def destroy_dropped(runtime) -> None:
        """Free the graphs dropped so far (an in-flight one is freed when it completes)."""
        while StreamGraph._dropped:
            executable, graph = StreamGraph._dropped.pop()
            if executable is not None:
                runtime.cudaGraphExecDestroy(executable)
            if graph is not None:
                runtime.cudaGraphDestroy(graph)


def graphs_per_parity(capture) -> tuple[list, str | None]:
    """(graphs, why not) of a copy-engine call being prepared: capture(parity) for both epoch
    parities (a StreamGraph each, or what the caller keeps with it) where AXEDIST_CE_GRAPHS is on,
    no CUDA graph is being captured on the current stream and the driver can capture them;
    else no graphs and the reason (the call then issues its copies one by one)."""
    if not read_environment("AXEDIST_CE_GRAPHS"):
        return [], "AXEDIST_CE_GRAPHS is off"
    if torch.cuda.is_current_stream_capturing():
        return [], "prepared inside a CUDA graph capture"
    try:
        return [capture(parity) for parity in (0, 1)], None
    except RuntimeError as error:
        return [], str(error)


def copy_engines_usable() -> bool:
    """Whether this process can issue the "/ce" kernels' copies and stream waits (cuda-python's
    runtime and driver bindings). A local fact: the fused calls make every rank agree on it."""
    return copy_engine_runtime() is not None and stream_memory_driver() is not None
