"""`--engines_per_gpu K`: K vLLM engines for a rank, each in a process of its own on the rank's GPU,
behind the in-process engine's interface (rollout.VLLMEngine), and the process protocol between
them: commands over a pipe, the weights through one flat buffer every engine maps.
"""

import atexit
import contextlib
import gc
import os
import traceback
from collections.abc import Iterable

import torch
import torch.distributed as dist

from rollout import Sample, VLLMEngine, meta_model


class EnginePool:
    """`--engines_per_gpu K`: K vLLM engines for this rank, each in a process of its own on the
    rank's GPU, behind VLLMEngine's interface.

    A small model's generation is bound by vLLM's host work, not by the GPU: its scheduler and
    KV-cache bookkeeping take about 20 us per sequence per decoding step, and an H200 decoding
    Qwen2.5-0.5B ran kernels a fifth of the time (docs/benchmarks.md). K engines each decode a K-th
    of the sequences and do that host work on K cores at once, while their kernels share the GPU.

    Each engine is a VLLMEngine in a spawned process, driven over a pipe (`_serve_engine`). A call
    splits the prompts into K contiguous shares, engine i sampling its share with seed + i. The
    weights travel through one flat buffer that this process owns and every engine maps (CUDA IPC on
    a GPU, shared memory on CPU): a push copies the trainer's full tensors into it, then the K
    engines load from views of it at once. The buffer is one more copy of the weights; it lives from
    a push to the next sleep, so the trainer does not hold it while it trains. The engines start
    together, so each is given its KV cache's size instead of measuring the memory left, which the
    others' start would upset.

    The pool returns while its engines start (about 30 s on an H200): the first call that needs
    them, or `started()`, waits for them. The train scripts compile their passes meanwhile
    (`compile_ahead`).
    """

    in_process = (
        False  # its engines' forwards run in their own processes: no turns to take with traces
    )

    def __init__(
        self,
        model_path: str,
        *,
        engines: int,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 1024,
        seed: int = 0,
        dtype: str = "bfloat16",
        **engine_kwargs,
    ):
        if tensor_parallel_size != 1:
            raise ValueError("--engines_per_gpu above 1 needs --tensor_model_parallel_size 1")
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        self.dp_rank, self.dp_size, self.tp_rank, self.tp = rank, world, 0, 1
        self.on_gpu, self.sleeping = torch.cuda.is_available(), False
        self.buffer, self.layout, self.buffer_kind = None, None, None
        kwargs = dict(
            engine_kwargs,
            dtype=dtype,
            max_num_seqs=-(-max_num_seqs // engines),
            gpu_memory_utilization=gpu_memory_utilization / engines,
        )
        env = {}
        if self.on_gpu:
            kwargs["kv_cache_memory_bytes"] = pool_kv_cache_bytes(
                model_path, dtype, gpu_memory_utilization, engines
            )
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = torch.cuda.current_device()
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        ctx = torch.multiprocessing.get_context("spawn")
        self.conns, self.procs, self.starting = [], [], True
        for i in range(engines):
            mine, theirs = ctx.Pipe()
            # one engine's start-up log is enough
            quiet = {} if i == 0 else {"VLLM_LOGGING_LEVEL": "WARNING"}
            proc = ctx.Process(
                target=_serve_engine,
                name=f"engine{i}",
                args=(
                    theirs,
                    model_path,
                    dict(kwargs, seed=seed + rank * engines + i),
                    env | quiet,
                ),
            )
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        atexit.register(self.close)

    def started(self) -> None:
        """Wait until every engine has started; raises the error of one that failed."""
        if self.starting:
            self.starting = False
            self._collect("start")

    def _collect(self, what: str, engines: list[int] | None = None) -> list:
        """Each engine's answer to its last command, in order. Every answer is read before an
        engine's exception is raised here, so none is left in a pipe to be taken for the next
        command's."""
        engines = range(len(self.conns)) if engines is None else engines
        answers = []
        for i in engines:
            try:
                answers.append(self.conns[i].recv())
            except EOFError:
                answers.append(("error", "its process exited (its output above says why)"))
        for i, (status, value) in zip(engines, answers):
            if status == "error":
                raise RuntimeError(f"rollout engine {i} failed during {what}:\n{value}")
        return [value for _, value in answers]

    def _all(self, command: str, *args) -> list:
        self.started()
        for conn in self.conns:
            conn.send((command, args))
        return self._collect(command)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        seed: int | None = None,
        logprobs: bool | list[bool] = True,
        **kwargs,
    ) -> list[list[Sample]]:
        """As VLLMEngine.generate, each engine sampling a contiguous share of the prompts."""
        if self.sleeping:
            raise RuntimeError("EnginePool.generate while asleep: call update_weights() first")
        self.started()
        k = len(self.conns)
        wanted = logprobs if isinstance(logprobs, list) else [logprobs] * len(prompt_token_ids)
        bounds = [len(prompt_token_ids) * i // k for i in range(k + 1)]
        busy = []
        for i, conn in enumerate(self.conns):
            lo, hi = bounds[i], bounds[i + 1]
            if lo < hi:
                share = dict(
                    kwargs, seed=None if seed is None else seed + i, logprobs=wanted[lo:hi]
                )
                conn.send(("generate", (prompt_token_ids[lo:hi], share)))
                busy.append(i)
        return [out for outs in self._collect("generate", busy) for out in outs]

    def sleep(self) -> None:
        """The engines release their weights and KV cache (on a GPU), and the weight buffer goes:
        every engine drops its views of it, then this process frees it. The next push allocates and
        maps it again."""
        if self.on_gpu and not self.sleeping:
            self._all("sleep")
            self.sleeping = True
        if self.buffer is not None:
            self._all("unmap_weights")
            self.buffer = None
            if self.on_gpu:
                torch.cuda.ipc_collect()  # frees what an engine let go of late
                torch.cuda.empty_cache()  # back to the GPU, as the engines' own memory went

    def wake_up(self) -> None:
        if self.on_gpu and self.sleeping:
            self._all("wake_up")
        self.sleeping = False

    def unbacked_bytes(self) -> int:
        return 0  # the engines' memory belongs to their own processes

    def torch_memory(self) -> list[dict]:
        """What torch's allocator counts in each engine's process, in bytes: `reserved` (cached,
        CUDA graphs' pools included), `allocated`, and `unbacked`, the part of those that vLLM's
        sleep-mode pool (weights, KV cache) has released while asleep, which torch goes on counting.
        Zeros on CPU. The rest of an engine's GPU memory is outside torch's allocator, mostly its
        CUDA context."""
        return self._all("torch_memory")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors named as in the Hugging Face checkpoint into the shared buffer, then
        have every engine load them (waking it first, as VLLMEngine.update_weights does). The first
        push sets the buffer's layout; later ones must bring the same names and shapes. After a
        sleep the buffer is allocated again and every engine maps it anew."""
        self.started()
        # the first push: its tensors give the layout, so they are all taken at once
        if self.layout is None:
            named_tensors = [(name, t.detach()) for name, t in named_tensors]
            offsets = [0]
            for _, t in named_tensors:
                offsets.append(offsets[-1] + t.numel())
            dtypes = {t.dtype for _, t in named_tensors}
            if len(dtypes) != 1:
                raise ValueError(
                    f"EnginePool.update_weights: one dtype expected, got {sorted(map(str, dtypes))}"
                )
            self.layout = [(name, offsets[j], t.shape) for j, (name, t) in enumerate(named_tensors)]
            self.buffer_kind = (offsets[-1], dtypes.pop(), named_tensors[0][1].device)
        mapped = self.buffer is not None
        if not mapped:
            size, dtype, device = self.buffer_kind
            self.buffer = torch.empty(size, dtype=dtype, device=device)
            if not self.buffer.is_cuda:
                self.buffer.share_memory_()
        try:
            n = 0
            for (name, t), (expected, offset, shape) in zip(named_tensors, self.layout):
                if name != expected or t.shape != shape:
                    raise ValueError(
                        f"EnginePool.update_weights: got {name} {tuple(t.shape)} where the first "
                        f"push had {expected} {tuple(shape)}"
                    )
                self.buffer[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
                n += 1
            if n != len(self.layout):
                raise ValueError(
                    f"EnginePool.update_weights: {n} tensors, the first push had {len(self.layout)}"
                )
        except BaseException:
            if not mapped:  # no engine has seen it: the next push starts over
                self.buffer = None
            raise
        del named_tensors
        if self.on_gpu:
            # the copies are done before other processes read
            torch.cuda.current_stream().synchronize()
            if self.sleeping:
                # what torch caches for the trainer: the engines wake into it
                torch.cuda.empty_cache()
        if not mapped:
            # one record per engine: torch counts the readers of a shared CUDA tensor per record
            # sent, and keeps the memory until each has let go
            for conn in self.conns:
                conn.send(("map_weights", (*_shareable(self.buffer), self.layout)))
            self._collect("map_weights")
        self._all("load_weights")
        self.sleeping = False

    def close(self) -> None:
        """Stop the engines (idempotent; also run at exit). Engines still starting are killed: the
        trainer failed before it needed them."""
        for conn, proc in zip(self.conns, self.procs):
            if not self.starting:
                with contextlib.suppress(OSError):
                    conn.send(("close", ()))
                proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []
        atexit.unregister(self.close)


# what torchrun tells its workers: an engine's own process must not take itself for one of them
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _serve_engine(conn, model_path: str, kwargs: dict, env: dict) -> None:
    """An EnginePool engine's process: build a VLLMEngine, then answer commands until told to close
    or until the trainer's end of the pipe closes. Every answer is ("ok", value) or ("error",
    traceback)."""
    for var in TORCHRUN_ENV:
        os.environ.pop(var, None)
    for var in [v for v in os.environ if v.startswith("TORCHELASTIC_")]:
        os.environ.pop(var)
    os.environ.update(env)
    try:
        engine = VLLMEngine(model_path, **kwargs)
    except BaseException:  # noqa: BLE001 - sent to the trainer, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    try:
        conn.send(("ok", None))
    except BrokenPipeError:  # the trainer is gone (it died while this engine started)
        return
    views = []
    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the trainer is gone
            return
        try:
            value = None
            if command == "close":
                conn.send(("ok", None))
                return
            if command == "map_weights":  # the trainer's buffer, and where each tensor lies in it
                rebuild, fields, layout = args
                buffer = rebuild(*fields)
                views = [
                    (name, buffer[offset : offset + shape.numel()].view(shape))
                    for name, offset, shape in layout
                ]
                # the views alone hold the buffer (on CPU, so does fields)
                del (
                    buffer,
                    rebuild,
                    fields,
                    layout,
                    args,
                )
            # the trainer frees the buffer once every engine has let go of it
            elif command == "unmap_weights":
                views = []
                gc.collect()
            elif command == "load_weights":
                if not views:
                    raise RuntimeError(
                        "load_weights before map_weights: this engine has no weights to load"
                    )
                engine.update_weights(iter(views))
                if engine.on_gpu:
                    torch.cuda.synchronize()  # loaded before the trainer may write the buffer again
            elif command == "generate":
                prompts, share = args
                value = engine.generate(prompts, **share)
            elif command == "torch_memory":
                value = (
                    {
                        "reserved": torch.cuda.memory_reserved(),
                        "allocated": torch.cuda.memory_allocated(),
                        "unbacked": engine.unbacked_bytes(),
                    }
                    if engine.on_gpu
                    else {"reserved": 0, "allocated": 0, "unbacked": 0}
                )
            elif command in ("sleep", "wake_up"):
                getattr(engine, command)()
                if command == "sleep" and engine.on_gpu:
                    # all that torch caches in this process serves the sleeping engine
                    torch.cuda.empty_cache()
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", value))
        except Exception:  # noqa: BLE001 - sent to the trainer, which raises it
            conn.send(("error", traceback.format_exc()))


def _shareable(buffer: torch.Tensor) -> tuple:
    """torch's (rebuild, fields) of `buffer`, which an engine's process turns back into the same
    memory (CUDA IPC, or shared memory on CPU). The engines see only their GPU, as device 0
    (CUDA_VISIBLE_DEVICES), where this process may see it under another index: the device index in
    torch's CUDA record is rewritten for them."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, fields = reduce_tensor(buffer)
    if buffer.is_cuda:
        # rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, device, ...)
        device_field = 6
        if fields[device_field] != buffer.device.index:
            raise RuntimeError(
                f"torch's CUDA IPC record has changed shape ({rebuild.__name__}): update _shareable"
            )
        fields = (*fields[:device_field], 0, *fields[device_field + 1 :])
    return rebuild, fields


def pool_kv_cache_bytes(
    model_path: str, dtype: str, gpu_memory_utilization: float, engines: int
) -> int:
    """The KV cache of each of `engines` engines sharing `gpu_memory_utilization` of this GPU: its
    share less room for the weights twice (its copy and a load's buffers) and 3 GiB for activations
    and CUDA graphs. The weights' size comes from the model's config, built without memory (meta
    device)."""
    weights = sum(p.numel() for p in meta_model(model_path).parameters())
    weights *= getattr(torch, dtype).itemsize
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    share = total * gpu_memory_utilization / engines
    kv = int(share - 2 * weights - 3 * 2**30)
    if kv < 2**30:
        raise ValueError(
            f"--engines_per_gpu {engines}: each engine's share of --gpu_memory_utilization "
            f"{gpu_memory_utilization} ({share / 2**30:.1f} GiB) leaves {kv / 2**30:.1f} GiB for "
            "its KV cache after the weights (at least 1 GiB is needed): raise "
            "--gpu_memory_utilization or lower --engines_per_gpu"
        )
    return kv
