"""Ahead-of-time compilation of the Triton kernels for real GPUs, on any machine (no GPU needed).

The interpreter accepts programs that the compiler cannot launch (too much shared memory,
register spills), so the launches are checked here the way a GPU would see them:
``record_launches`` runs ``attention_forward`` + ``attention_backward`` with a recorder in place
of the kernels module (the dispatcher's own code picks grids and blocks; each config of warps and
stages the kernel's autotuner may pick is one launch; nothing is computed), and ``compile_launch``
compiles one launch with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``; ptxas (shipped in the triton wheel) reports registers and
spills, Triton's metadata the shared memory. ``benchmarks/triton_aot.py`` runs every shipped shape;
``record_window_launches`` records the window hybrid's launches (``window.py``) the same way.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from dataclasses import asdict, dataclass

import torch

from .launch import ChunkPlan, TrigMap, chunk_plan, kernel_chunk
from .linear import attention_backward, attention_forward, map_backward

# Shared memory per block (opt-in maximum) of the targets the kernels must launch on.
SHARED_MEMORY_LIMIT = {80: 166_912, 90: 232_448}
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler sees it: argument types, constexprs and launch options."""

    kernel: str
    signature: tuple[tuple[str, str], ...]  # (argument, Triton type) of the runtime arguments
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int


@dataclass
class Compiled:
    """Resource usage of one launch compiled for one target."""

    kernel: str
    arch: int
    constexprs: dict
    dtype: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    tensor_cores: bool  # mma / wgmma instructions in the PTX
    fits: bool  # shared memory within SHARED_MEMORY_LIMIT[arch]

    def as_dict(self) -> dict:
        return asdict(self)


class _Recorder:
    """Stands in for the kernels module: ``rec.name[grid](*args, **kwargs)`` records the launch."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def __getattr__(self, kernel: str):
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder._record(kernel, args, kwargs)

        return _Grid()

    def _record(self, kernel: str, args: tuple, kwargs: dict) -> None:
        tuner = _tuner(kernel)
        fn = _jit_function(kernel)
        runtime = [name for name, p in zip(fn.arg_names, fn.params) if not p.is_constexpr]
        if len(runtime) != len(args):
            raise TypeError(f"{kernel}: {len(args)} arguments for {len(runtime)} parameters")
        signature = tuple((name, _arg_type(value)) for name, value in zip(runtime, args))
        constexprs = tuple(sorted(kwargs.items()))
        # every config the autotuner may pick at this launch (after its pruning) is one compile
        for config in tuner.early_config_prune(tuner.configs, {}, **kwargs):
            launch = Launch(kernel, signature, constexprs, config.num_warps, config.num_stages)
            if launch not in self.launches:
                self.launches.append(launch)


def _tuner(kernel: str):
    """``kernel``'s autotuner: the linear kernels' (``linear_kernels.py``) or the window hybrid's (``window_kernels.py``)."""
    from . import linear_kernels, window_kernels

    return getattr(linear_kernels, kernel, None) or getattr(window_kernels, kernel)


def _jit_function(kernel: str):
    """The ``triton.jit`` function under ``kernel``'s autotuner (RuntimeError when interpreted)."""
    from triton.runtime.jit import JITFunction

    fn = _tuner(kernel).fn
    if not isinstance(fn, JITFunction):
        raise RuntimeError("the Triton kernels were loaded under TRITON_INTERPRET=1: compile them in a process without it")
    return fn


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {type(value).__name__}")


def record_launches(
    feat: int, dv: int, dtype: torch.dtype, chunk_size: int, *, bh: int, normalization: str = "rms",
    trig_head_dim: int | None = None, paired: bool = True,
) -> list[Launch]:  # fmt: skip
    """Every distinct launch of one forward + backward at (BH = ``bh``, F, Dv, dtype, chunk), times
    the configs each kernel's autotuner may pick. ``trig_head_dim``: the trig map's path (the
    kernels compute the features from q, k [BH, N, d] and omega; plus the map's backward kernel),
    else features given as inputs."""
    recorder = _Recorder()
    n = 2 * kernel_chunk(chunk_size) + 3  # several chunks, the last one partial
    plan: ChunkPlan = chunk_plan(torch.zeros(bh, n), torch.full((bh,), float("-inf")), feat, dv, chunk_size)
    width = feat
    if trig_head_dim is not None:
        width = trig_head_dim
        plan.trig = TrigMap(torch.zeros(1, feat if paired else feat // 2, width), paired, 1.0)
    q, k = torch.empty(bh, n, width, dtype=dtype), torch.empty(bh, n, width, dtype=dtype)
    v, ls = torch.empty(bh, n, dv, dtype=dtype), torch.zeros(bh, n)
    kv0, z0 = torch.zeros(bh, feat, dv), torch.zeros(bh, feat)
    attention_forward(q, k, ls, v, kv0, z0, plan, normalization, 1e-6, dtype, kern=recorder)
    dqf, _, _, _, _, _ = attention_backward(q, k, ls, v, kv0, z0, plan, normalization, 1e-6, None, None, None, kern=recorder)
    if plan.trig is not None:
        map_backward(q, dqf, plan, kern=recorder)
    return recorder.launches


def record_window_launches(
    head_dim: int, feat: int, dv: int, dtype: torch.dtype, chunk_size: int, *, bh: int, window: int = 64
) -> list[Launch]:
    """Every distinct launch of one forward + backward of the window hybrid's Triton form
    (``window.py``: the linear state's scans over Dv + 1 columns, ``window_outputs``,
    ``window_grads_q``, ``window_grads_k``) at (BH, head dim, F, Dv, dtype, chunk). The window
    and the lookback are runtime arguments: one W compiles every W."""
    from .window import window_backward, window_chunk, window_forward, window_plan

    recorder = _Recorder()
    c = window_chunk(chunk_size)  # what the dispatcher (window._triton_function) passes
    t = 3 * c
    q, k = torch.zeros(bh, t, head_dim, dtype=dtype), torch.zeros(bh, t, head_dim, dtype=dtype)
    qf, kf = torch.zeros(bh, t, feat, dtype=dtype), torch.zeros(bh, t, feat, dtype=dtype)
    qls, kls, v_aug = torch.zeros(bh, t), torch.zeros(bh, t), torch.zeros(bh, t, dv + 1, dtype=dtype)
    s0, m0 = torch.zeros(bh, feat, dv + 1), torch.full((bh,), float("-inf"))
    plan = window_plan(q, kf, kls, v_aug, m0, window, c)
    numer, m = window_forward(q, qf, qls, k, kf, kls, v_aug, s0, plan, kern=recorder, wkern=recorder)
    window_backward(q, qf, qls, k, kf, kls, v_aug, s0, m0, m, numer, plan, kern=recorder, wkern=recorder)
    return recorder.launches


def _attrs(launch: Launch) -> dict:
    """The JIT's specialisation for pointers (torch allocations are 16-byte aligned)."""
    return {(i,): [["tt.divisibility", 16]] for i, (_, kind) in enumerate(launch.signature) if kind.startswith("*")}


def _source(launch: Launch):
    """Triton's ``ASTSource`` of ``launch`` (the kernel with its signature and constexprs)."""
    from triton.compiler import ASTSource

    fn = _jit_function(launch.kernel)
    constexprs = dict(launch.constexprs)
    signature = dict(launch.signature) | {name: "constexpr" for name in constexprs}
    index = {name: i for i, name in enumerate(fn.arg_names)}
    return ASTSource(fn, signature, constexprs={(index[k],): v for k, v in constexprs.items()}, attrs=_attrs(launch))


def _compile(launch: Launch, arch: int):
    """(Triton's compiled kernel, the ptxas -v log) of ``launch`` for sm_``arch``."""
    import triton
    from triton.backends.compiler import GPUTarget

    source = _source(launch)
    log = io.StringIO()
    knobs = triton.knobs
    # a fresh cache: ptxas must run (its -v log is the only source of registers and spills here)
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(
            source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
        )
    return compiled, log.getvalue()


def launch_ttir(launch: Launch, arch: int = 80) -> str:
    """The Triton IR (TTIR) of ``launch``: what its address arithmetic is, before any lowering.
    Only the front end and the TTIR passes run (the same stage ``triton.compile`` starts with),
    not the GPU lowering and ptxas that ``compile_launch`` needs."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", arch, 32))
    options = backend.parse_options(dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = _source(launch)
    module = source.make_ir(backend.target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, options, source.language)
    return str(stages["ttir"](module, {}))


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile ``launch`` for sm_``arch`` (80 or 90) and read its resource usage."""
    compiled, log = _compile(launch, arch)
    shared = int(compiled.metadata.shared)
    dtype = next(kind for name, kind in launch.signature if name in ("Q", "K", "X"))[1:]
    return Compiled(
        kernel=launch.kernel, arch=arch, constexprs=dict(launch.constexprs), dtype=dtype,
        num_warps=launch.num_warps, num_stages=launch.num_stages, shared_bytes=shared,
        tensor_cores=bool(re.search(r"\b(wgmma|mma)\.", compiled.asm["ptx"])),
        fits=shared <= SHARED_MEMORY_LIMIT[arch], **parse_ptxas_log(log),
    )  # fmt: skip


def parse_ptxas_log(log: str) -> dict[str, int]:
    """registers, spill stores/loads and stack frame (bytes per thread) from ``ptxas -v`` output."""

    def number(pattern: str) -> int:
        found = re.findall(pattern, log)
        if not found:
            raise ValueError(f"ptxas log without {pattern!r}: {log[-500:]!r}")
        return max(int(x) for x in found)

    return dict(
        registers=number(r"Used (\d+) registers"),
        spill_store_bytes=number(r"(\d+) bytes spill stores"),
        spill_load_bytes=number(r"(\d+) bytes spill loads"),
        stack_bytes=number(r"(\d+) bytes stack frame"),
    )
